"""CPU time of the server's prefill chunks and decode steps at the chat-8x4 shape, per model and slot
dtype, in one process and taking turns (issue 35: which dtype the server should run on this CPU).

The scheduler over ``ModelBackend`` in-process (no HTTP), K chats of prompts cut from Tiny Shakespeare,
R greedy tokens each, ``--rows`` rows at the server's default budget (0.2 of the window: 1,638 slots of
SmolLM2-135M). Each configuration serves the same chats, round after round in turn, so the machine's
load falls on all of them alike; figures are process CPU seconds (``time.process_time``), one thread.

    python benchmarks/serve_step_dtype.py --config float32/auto --config bfloat16/auto \
        --config bfloat16/float32 --rounds 2 --out benchmarks/results_serve_step_dtype.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from json_report import emit

ROOT = Path(__file__).resolve().parents[1]
# the shared data folder: beside the checkout or a worktree folder above it
DATA = next((up / "shared" / "data" for up in ROOT.parents if (up / "shared" / "data").is_dir()), ROOT.parent / "shared" / "data")
sys.path.insert(0, str(ROOT / "tests"))  # (serve_fakes: the request and drain helpers the tests use)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--config", action="append", help="MODEL_DTYPE/KV_DTYPE, e.g. bfloat16/auto (repeat)")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--reply", type=int, default=32)
    parser.add_argument("--history-chars", type=int, default=2400)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--text", type=Path, default=DATA / "tinyshakespeare.txt")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    configs = args.config or ["float32/auto", "bfloat16/auto"]

    import torch

    from h2ochat.config import CacheSettings
    from h2ochat.loading.models import load
    from h2ochat.serve.backend import ModelBackend
    from h2ochat.serve.parked import ParkedStore
    from h2ochat.serve.scheduler import Scheduler
    from serve_fakes import drain, generated, make_request

    torch.set_num_threads(1)
    models = {dtype: load(args.model, device="cpu", dtype=dtype) for dtype in {c.split("/")[0] for c in configs}}
    tokenizer = next(iter(models.values())).tokenizer
    text = args.text.read_text(encoding="utf-8")
    rng = random.Random(1)
    starts = [rng.randrange(0, len(text) - args.history_chars) for _ in range(args.chats)]
    prompts = [tokenizer(text[start:start + args.history_chars]).input_ids for start in starts]

    def serve_once(config: str) -> dict:
        model_dtype, kv_dtype = config.split("/")
        model = models[model_dtype].model
        settings = CacheSettings(budget=args.budget, kv_dtype=kv_dtype)
        backend = ModelBackend(model, settings, args.rows, store=ParkedStore(0), prefill_chunk=args.prefill_chunk)
        spent = {"prefill": 0.0, "decode": 0.0}

        def timed(name, call):
            def wrapper(*a, **k):
                started = time.process_time()
                try:
                    return call(*a, **k)
                finally:
                    spent[name] += time.process_time() - started
            return wrapper

        for name in spent:
            setattr(backend, name, timed(name, getattr(backend, name)))
        scheduler = Scheduler(backend)
        requests = [make_request(prompt, max_tokens=args.reply, stop_ids=()) for prompt in prompts]
        for request in requests:
            scheduler.submit(request)
        started = time.process_time()
        drain(scheduler, limit=1_000_000)
        total = time.process_time() - started
        return {"cpu_s": total, "prefill_cpu_s": spent["prefill"], "decode_cpu_s": spent["decode"],
                "tokens": [generated(request)[0] for request in requests]}

    runs: dict[str, list[dict]] = {config: [] for config in configs}
    for _ in range(args.rounds):
        for config in configs:
            runs[config].append(serve_once(config))
            print(config, {k: round(v, 2) for k, v in runs[config][-1].items() if k != "tokens"}, flush=True)
    base = runs[configs[0]]
    summary = {}
    for config, results in runs.items():
        figures = {key: round(sum(r[key] for r in results) / len(results), 2)
                   for key in ("cpu_s", "prefill_cpu_s", "decode_cpu_s")}
        figures["cpu_ratio_to_first"] = round(sum(r["cpu_s"] for r in base) / sum(r["cpu_s"] for r in results), 3)
        figures["same_tokens_as_first"] = sum(a == b for a, b in zip(results[0]["tokens"], base[0]["tokens"]))
        summary[config] = figures
    report = {"argv": sys.argv, "threads": 1, "prompt_tokens": sum(map(len, prompts)),
              "generated_tokens": args.chats * args.reply, "configs": summary}
    emit(report, args.out)


if __name__ == "__main__":
    main()
