"""A prompt's prefill under two checkouts of h2ochat, side by side: the CPU time to read a chunk of new tokens after a
history (a served chat's later turn: the history read first, untimed), with recall at its default, each checkout in
processes of its own that take turns (rounds in alternating order), so that the machine's load falls on both alike.

    git worktree add /tmp/base <commit>   # (and build its kernels: python setup.py build_ext --inplace there)
    python benchmarks/prefill_side_by_side.py --tree before=/tmp/base --tree after=. \
        --text ../shared/data/gfdl-1.3.txt --out benchmarks/results_prefill_side_by_side.json

CPU seconds of one compute thread by default (``--threads``): a noisy shared machine moves wall time more than CPU
time. Each case: a fresh cache of the product's defaults (``CacheSettings(recall="auto")``), ``HISTORY`` tokens of
the text read, then ``NEW`` more timed; the median over ``--repeats`` (the first of each process dropped: warm-up),
then the median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package
from json_report import emit  # noqa: E402

DEFAULT_CASES = "0+330,700+375,1080+375,2000+375"  # a chat's turns of the peers' load: ~375 new tokens a turn


def parse_cases(text: str) -> list[tuple[int, int]]:
    """"H+N,..." -> [(history, new), ...]."""
    cases = []
    for item in text.split(","):
        history, _, new = item.strip().partition("+")
        if not new or int(new) < 1 or int(history) < 0:
            raise argparse.ArgumentTypeError(f"a case is HISTORY+NEW tokens (NEW >= 1), got {item!r}")
        cases.append((int(history), int(new)))
    return cases


def worker(args) -> None:
    """In the checkout on PYTHONPATH: each case's median CPU (and wall) seconds, as one JSON line."""
    import time

    import torch

    from h2ochat import threads
    from h2ochat.engine.generation import CacheSettings, prefill
    from h2ochat.loading.models import load

    threads.apply(args.threads)
    loaded = load(args.model, "cpu", args.dtype)
    ids = loaded.tokenizer(Path(args.text).read_text(), return_tensors="pt").input_ids
    result = {}
    for history, new in parse_cases(args.cases):
        if ids.shape[1] < history + new:
            raise SystemExit(f"the text holds {ids.shape[1]} tokens, fewer than {history} + {new}")
        cpu, wall = [], []
        for _ in range(args.repeats + 1):
            cache = CacheSettings(recall="auto").build(loaded.model)
            with torch.inference_mode():
                if history:
                    prefill(loaded.model, cache, ids[:, :history])
                started, clock = time.process_time(), time.perf_counter()
                prefill(loaded.model, cache, ids[:, history:history + new])
            cpu.append(time.process_time() - started)
            wall.append(time.perf_counter() - clock)
        result[f"{history}+{new}"] = {"cpu_s": statistics.median(cpu[1:]), "wall_s": statistics.median(wall[1:])}
    print(json.dumps({"source": str(Path(sys.modules["h2ochat"].__file__).parent), "cases": result}))


def run_tree(path: Path, args) -> dict:
    """One worker process over the checkout at ``path``."""
    env = {**os.environ, "PYTHONPATH": str(path)}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model, "--dtype", args.dtype,
               "--text", str(Path(args.text).resolve()), "--cases", args.cases, "--repeats", str(args.repeats),
               "--threads", str(args.threads)]
    done = subprocess.run(command, cwd=path, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the worker over {path} failed: {done.stderr.strip().splitlines()[-1:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(report["source"]).resolve() != (path / "h2ochat").resolve():
        raise SystemExit(f"the worker over {path} imported h2ochat from {report['source']}")
    return report["cases"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="a checkout to time (twice: the two sides)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--text", required=True)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="HISTORY+NEW tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed prefills per case and process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per checkout, taking turns")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    parse_cases(args.cases)
    if args.worker:
        worker(args)
        return 0
    trees = dict(tree.split("=", 1) for tree in args.tree)
    if len(trees) != 2:
        parser.error("give two checkouts: --tree NAME=DIR --tree NAME=DIR")
    names = list(trees)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            runs[name].append(run_tree(Path(trees[name]).resolve(), args))
            print(f"round {round_ + 1}: {name} done", file=sys.stderr)
    cases = {}
    for case in runs[names[0]][0]:
        medians = {name: {kind: statistics.median(run[case][kind] for run in runs[name]) for kind in ("cpu_s", "wall_s")}
                   for name in names}
        cases[case] = {**medians, f"cpu_{names[1]}_over_{names[0]}": medians[names[1]]["cpu_s"] / medians[names[0]]["cpu_s"]}
    emit({"model": args.model, "dtype": args.dtype, "text": Path(args.text).name, "threads": args.threads,
          "rounds": args.rounds, "repeats": args.repeats, "trees": {name: str(trees[name]) for name in names},
          "cases": cases, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
