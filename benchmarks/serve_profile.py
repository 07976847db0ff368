"""Where the serve engine's time goes under the load benchmark's opening turns (issue 23): the
scheduler over ``ModelBackend`` in-process (no HTTP), K chats of ~620-token Tiny Shakespeare histories
read in chunks and answered with R tokens each, profiled with cProfile. Prints the wall time, the time
in the backend's prefill and decode calls, the decode steps per bucket size and the top functions by
own time; ``--out`` writes those figures as JSON.

    OMP_NUM_THREADS=1 python benchmarks/serve_profile.py --policy h2o --budget 128 --rows 17 --chats 16
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import time
from pathlib import Path
from json_report import write

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # (serve_fakes: the request and drain helpers the tests use)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--budget", default="128")
    parser.add_argument("--recall", default=None)
    parser.add_argument("--rows", type=int, default=17)
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--reply", type=int, default=16)
    parser.add_argument("--history-chars", type=int, default=2000)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--prefill-chunks-per-step", type=int, default=1)
    parser.add_argument("--text", type=Path, default=ROOT.parent / "shared" / "data" / "tinyshakespeare.txt")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from h2ochat.engine.generation import CacheSettings
    from h2ochat.loading.models import load
    from h2ochat.serve.backend import ModelBackend
    from h2ochat.serve.parked import ParkedStore
    from h2ochat.serve.scheduler import Scheduler
    from serve_fakes import drain, make_request

    loaded = load(args.model)
    text = args.text.read_text(encoding="utf-8")
    rng = random.Random(1)
    starts = [rng.randrange(0, len(text) - args.history_chars) for _ in range(args.chats)]
    prompts = [loaded.tokenizer(text[start:start + args.history_chars]).input_ids for start in starts]
    settings = CacheSettings(policy=args.policy, budget=args.budget, recall=args.recall)
    backend = ModelBackend(loaded.model, settings, args.rows, store=ParkedStore(1 << 33),
                           prefill_chunk=args.prefill_chunk)
    spent = {"prefill": [0.0, 0], "decode": [0.0, 0]}

    def timed(name, call):
        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                spent[name][0] += time.perf_counter() - started
                spent[name][1] += 1
        return wrapper

    for name in spent:
        setattr(backend, name, timed(name, getattr(backend, name)))  # (the script's own backend object)
    scheduler = Scheduler(backend, args.prefill_chunks_per_step)
    requests = [make_request(prompt, max_tokens=args.reply, stop_ids=()) for prompt in prompts]
    for request in requests:
        scheduler.submit(request)
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    drain(scheduler, limit=1_000_000)
    profile.disable()
    wall = time.perf_counter() - started
    stats = pstats.Stats(profile)
    top = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:15]
    result = {
        "args": {k: str(v) for k, v in vars(args).items()}, "wall_s": round(wall, 2),
        "prompt_tokens": sum(map(len, prompts)), "generated_tokens": args.chats * args.reply,
        "prefill_s": round(spent["prefill"][0], 2), "prefill_calls": spent["prefill"][1],
        "decode_s": round(spent["decode"][0], 2), "decode_steps": spent["decode"][1],
        "decode_steps_by_rows": backend.steps_by_rows,
        "top_own_time": [{"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})", "own_s": round(own, 2),
                          "calls": calls} for (path, line, name), (calls, _, own, _, _) in top],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "top_own_time"}))
    report = io.StringIO()
    pstats.Stats(profile, stream=report).sort_stats("tottime").print_stats(15)
    print(report.getvalue())
    if args.out:
        write(result, args.out)


if __name__ == "__main__":
    main()
