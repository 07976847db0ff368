"""One chat on a recall server of many rows, timed in-process (issue 34: "free rows are skipped with recall
too"; session 64): SmolLM2-135M at its auto dtype, ``--budget`` slots with ``--recall`` of them recall's, every
row fed ``--context`` tokens (the other rows: conversations resting in their rows), then decode steps of row 0
alone, three ways, each in a process of its own, alternating ``--repeats`` times:

- ``one_row``: a cache of one row (a 1-row server);
- ``every_row``: the N-row cache, every row stepped, all but row 0 left out (``active``): a recall server's
  one bucket before session 64;
- ``bucket``: the N-row cache's prefix of its first row (``H2OCache.prefix(1)``, sharing the tiers): the
  smallest bucket, what a server runs now.

CPU time of the process per step (one thread), median over ``--steps`` after ``--warmup``.

    taskset -c 1 python benchmarks/recall_lone_chat.py --rows 8 32 --out benchmarks/results_recall_lone_chat_s64.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package
from json_report import emit  # noqa: E402

WAYS = ("one_row", "every_row", "bucket")


def one_run(args, way: str, rows: int) -> dict:
    """(In the child.) Row 0's decode steps, one way."""
    import torch

    from h2ochat.engine.forward_step import EagerDecode
    from h2ochat.engine.generation import CacheSettings, prefill
    from h2ochat.loading.models import load

    torch.set_num_threads(1)
    batch = 1 if way == "one_row" else rows
    model = load("smollm2-135m", decode_rows=batch).model
    cache = CacheSettings(budget=args.budget, recall=args.recall).build(model, static_shapes=True)
    generator = torch.Generator().manual_seed(0)
    prefill(model, cache, torch.randint(10, 40000, (batch, args.context), generator=generator), chunk=512)
    stepped = cache.prefix(1) if way == "bucket" else cache
    active = torch.zeros(stepped.tokens_fed.shape[0], dtype=torch.bool)
    active[0] = True
    decode = EagerDecode(model)
    tokens = torch.randint(10, 40000, (args.warmup + args.steps,), generator=generator)
    times = []
    for step in range(args.warmup + args.steps):
        fed = tokens[step].expand(active.shape[0])
        started = time.process_time()
        decode(stepped, fed, active)
        if step >= args.warmup:
            times.append((time.process_time() - started) * 1e3)
    return {"median_ms": statistics.median(times), "step_ms": times,
            "dtype": str(next(model.parameters()).dtype)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--budget", default="256")
    parser.add_argument("--recall", default="0.5")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(one_run(args, args.child[0], int(args.child[1]))))
        return {}
    plain = list(argv if argv is not None else sys.argv[1:])
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for rows in args.rows:
            for way in WAYS:
                if way == "one_row" and rows != args.rows[0]:
                    continue  # (one 1-row run a repeat)
                name = way if way == "one_row" else f"{way}_{rows}"
                command = [sys.executable, __file__, "--child", way, str(rows), *plain]
                done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                                      text=True, check=True)
                run = json.loads(done.stdout.strip().splitlines()[-1])
                runs.setdefault(name, []).append(run)
                print(f"{name} run {repeat}: median {run['median_ms']:.1f} ms ({run['dtype']})", flush=True)
    medians = {name: statistics.median(run["median_ms"] for run in values) for name, values in runs.items()}
    report = {"settings": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
              "over_one_row": {name: round(value / medians["one_row"], 3) for name, value in medians.items()},
              "median_step_ms": medians, "runs": runs}
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main()
