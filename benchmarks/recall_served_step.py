"""A server's decode step with recall, timed in-process (issue 34, the served target; session 53): SmolLM2-135M
in bf16, one cache of ``--rows`` rows (a server's bucket), ``--budget`` slots with ``--recall`` of them recall's
(the served load's defaults: 256 and 0.5), every row fed ``--context`` tokens, then decode steps with some rows
left out (``--left-out``: a server's free rows, the ``active`` mask), timed one by one (CPU time of the
process, one thread). Three engines, each in a process of its own, alternating ``--repeats`` times: h2o alone
(no recall), recall on the torch route (``H2OCHAT_CPU_KERNELS=none``) and recall with the C route (default);
with ``--before DIR`` (an export of an earlier commit, ``git archive REV h2ochat | tar -x -C DIR``) that code's
default route too. ``--code DIR``: the package the other engines import (an export of this commit, so an
edit made while it runs changes nothing).

    taskset -c 1 python benchmarks/recall_served_step.py --out benchmarks/results_recall_served_step_s53.json

``--compile`` times the compiled step a CPU server runs (a static graph of ``--rows``; the first run of each
engine compiles it, untimed: minutes), ``--dtype float32`` the model as an AVX2 CPU's ``--dtype auto`` loads it,
``--profile N`` prints torch.profiler's top N ops of each run (with ``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1``,
inductor's kernels by name), ``--engines`` picks the engines (session 66):

    taskset -c 1 python benchmarks/recall_served_step.py --dtype float32 --compile --engines h2o,recall_native \
        --before /tmp/before --steps 48 --context 1000 --out benchmarks/results_recall_served_step_s66_fp32_compiled.json

Prints and writes each run's median step (ms), and the medians' ratios to h2o's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from json_report import write

ENGINES = {"h2o": ({}, None), "recall_torch": ({"H2OCHAT_CPU_KERNELS": "none"}, "0.5"),
           "recall_native": ({}, "0.5")}


def one_run(args) -> dict:
    """(In the child.) One engine's steps: {"step_ms": [...], ...}."""
    import torch

    from h2ochat.engine.compiled import CompiledDecode
    from h2ochat.engine.forward_step import EagerDecode
    from h2ochat.engine.generation import CacheSettings, prefill
    from h2ochat.loading.models import load

    torch.set_num_threads(1)
    loaded = load("smollm2-135m", dtype=args.dtype, decode_rows=args.rows)
    model = loaded.model
    settings = CacheSettings(budget=args.budget, recall=args.recall, kv_dtype=args.kv_dtype)
    cache = settings.build(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 40000, (args.rows, args.context), generator=generator)
    prefill(model, cache, ids, chunk=512)
    active = torch.ones(args.rows, dtype=torch.bool)
    active[[int(row) for row in args.left_out.split(",") if row]] = False
    decode = CompiledDecode(model) if args.compile else EagerDecode(model)
    tokens = torch.randint(10, 40000, (args.warmup + args.steps, args.rows), generator=generator)
    times = []
    for step in range(args.warmup):
        decode(cache, tokens[step], active)
    with _profiled(args.profile) as profile:
        for step in range(args.warmup, args.warmup + args.steps):
            started = time.process_time()
            decode(cache, tokens[step], active)
            times.append((time.process_time() - started) * 1e3)
    if profile is not None:
        print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile), file=sys.stderr)
    tier = getattr(cache.layers[0], "tier", None)
    return {"step_ms": times, "median_ms": statistics.median(times),
            "pages_copied_layer0": int(tier.frames.copied.sum()) if getattr(tier, "frames", None) is not None else 0}


def _profiled(rows: int):
    """torch.profiler around the timed steps when ``rows`` (the table's length) is set, else nothing;
    a compiled step's kernels are named in it with inductor's ``cpp.enable_kernel_profile``."""
    import torch

    if not rows:
        return contextlib.nullcontext()
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--left-out", default="2,5,7", help="rows left out of every timed step (comma-separated)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--budget", default="256")
    parser.add_argument("--recall", default="0.5")
    parser.add_argument("--kv-dtype", default="auto")
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype (the served load's on an AVX2 CPU: float32)")
    parser.add_argument("--compile", action="store_true", help="the compiled decode step, as a CPU server runs")
    parser.add_argument("--profile", type=int, default=0,
                        help="print torch.profiler's table of this many ops per run (to stderr)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"which of {', '.join(ENGINES)} to run")
    parser.add_argument("--before", help="a folder holding an earlier commit's h2ochat package: its default route too")
    parser.add_argument("--code", help="a folder holding the h2ochat package the other engines import")
    parser.add_argument("--out")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        args.recall = None if args.child == "h2o" else args.recall
        import h2ochat

        print(json.dumps({**one_run(args), "package": str(Path(h2ochat.__file__).parent)}))
        return {}
    engines = {name: ENGINES[name] for name in args.engines.split(",")}
    if args.code:
        engines = {name: ({**env, "PYTHONPATH": args.code}, recall) for name, (env, recall) in engines.items()}
    if args.before:
        engines["recall_before"] = ({"PYTHONPATH": args.before}, "0.5")
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        for name, (env, _) in engines.items():
            command = [sys.executable, __file__, "--child", name, *(argv if argv is not None else sys.argv[1:])]
            done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=subprocess.PIPE,
                                  text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append(run)
            print(f"{name} run {repeat}: median {run['median_ms']:.2f} ms, pages copied (layer 0) "
                  f"{run['pages_copied_layer0']}", flush=True)
    medians = {name: statistics.median(run["median_ms"] for run in values) for name, values in runs.items()}
    result = {"settings": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
              "median_step_ms": medians,
              "recall_over_h2o": {name: round(medians[name] / medians["h2o"], 3) for name in medians if name != "h2o"},
              "runs": runs}
    print(json.dumps({k: result[k] for k in ("median_step_ms", "recall_over_h2o")}, indent=1))
    if args.out:
        write(result, args.out)
    return result


if __name__ == "__main__":
    main()
