"""Time of a decode step's attention with its H2O scores, per layer: the torch route (``reference.attend_with_scores``,
what ``H2OCHAT_CPU_KERNELS=none`` runs) against each variant of the C kernel this CPU runs
(``h2ochat_kernels.cpu.attention_ops``), side by side: the routes take turns call by call so the machine's load
falls on all alike, one thread, CPU time. Shapes of a served SmolLM2-135M step: 3 KV heads, groups of 3, head dim 64, 1,638
slots full (the server's default), 8 rows and 1, bf16 and fp32. The target: the best variant at least 2x the torch
route at 8 rows in both dtypes (the torch route was 47% of a served step; the kernel should take it under a quarter).

    python benchmarks/cpu_attention.py --out benchmarks/results_cpu_attention.json

With ``--routed``: whole steps instead, the kernel routed (the default) against ``H2OCHAT_CPU_ATTENTION=0``, each a
process of its own taking turns with the other: ``h2ochat bench`` at a served step's shape (2,048 tokens of
context, 8 rows, a budget of 0.2, one thread, ``--compile`` for the eager and the compiled step) in fp32 and bf16,
its CPU ms per step; and ``h2ochat eval`` perplexity on a text, which must not move.

    python benchmarks/cpu_attention.py --routed --out benchmarks/results_cpu_attention_routed.json

With ``--chunks``: a prompt chunk (Q new tokens, causal among themselves) at a served prefill's shapes, one row: the
torch route (``reference.attend_with_scores``, its blocked layout) against the kernel, without and with a recall
tier's rest column; ``--threads 2``: both on two threads, wall time.

    python benchmarks/cpu_attention.py --chunks --out benchmarks/results_cpu_attention_chunks.json
    python benchmarks/cpu_attention.py --chunks --threads 2 --out benchmarks/results_cpu_attention_chunks_2threads.json
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from json_report import emit  # noqa: E402

from h2ochat_kernels import dispatch, reference  # noqa: E402
from h2ochat_kernels.cpu import attention_ops, variants  # noqa: E402
from h2ochat_kernels.cpu import routes as routes_module  # noqa: E402

TARGET = 2.0  # the best variant's speedup over the torch route at 8 rows, in each dtype


def step(batch: int, slots: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    heads, group, dim = 3, 3, 64
    return dict(query=torch.randn(batch, heads, group, 1, dim, generator=g).to(dtype),
                cache_keys=torch.randn(batch, heads, slots, dim, generator=g).to(dtype),
                cache_values=torch.randn(batch, heads, slots, dim, generator=g).to(dtype),
                slot_token_index=torch.arange(slots).expand(batch, heads, slots).contiguous(),
                new_keys=torch.randn(batch, heads, 1, dim, generator=g).to(dtype),
                new_values=torch.randn(batch, heads, 1, dim, generator=g).to(dtype),
                new_valid=None, scale=dim ** -0.5, scores=torch.zeros(batch, heads, slots))


def routes(tensors: dict) -> dict:
    """name -> a call of one step: the torch route, each variant's kernel, and the kernel as the torch backend
    reaches it (``dispatch``: its checks included)."""
    calls = {"torch": lambda: reference.attend_with_scores(**tensors)}
    args = list(tensors.values())
    for variant in variants.of("attention"):
        if not dispatch.cpu_runs(variant):
            continue
        kernel, why = routes_module.cpu_checked("attention", attention_ops._checked, variant)
        if kernel is None:
            print(f"{variant.name}: {why}", file=sys.stderr)
            continue
        calls[variant.name] = lambda kernel=kernel: attention_ops._call(kernel, *args, 1.0, 1)
    calls["routed"] = lambda: dispatch.Backend("torch").attend_with_scores(*args)
    return calls


def measure(calls: dict, rounds: int, wall: bool = False) -> dict:
    """Median CPU microseconds of each call over ``rounds`` turns (each route once a turn, after a warm-up): CPU time
    (one thread), not wall time, so that other jobs on a shared machine do not count; ``wall``: wall time (several
    threads, where CPU time would count each)."""
    clock = time.perf_counter if wall else time.process_time
    times = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            started = clock()
            call()
            times[name].append(clock() - started)
    return {name: round(statistics.median(t) * 1e6, 1) for name, t in times.items()}


ROOT = Path(__file__).resolve().parents[1]
ROUTE_ENV = {"kernel": "1", "torch": "0"}  # H2OCHAT_CPU_ATTENTION per route


def _cli(route: str, *arguments: str) -> dict:
    """``python -m h2ochat.cli ARGUMENTS`` (its --json report) with the attention on ``route``."""
    env = {**os.environ, attention_ops.ROUTE_SWITCH: ROUTE_ENV[route], "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "h2ochat.cli", *arguments], env=env, cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def whole_steps(args) -> dict:
    """Per dtype: each route's bench (CPU ms per step, eager and compiled; the routes take turns, the order flipped
    each round) and its perplexity."""
    bench = ["bench", "--model", args.model, "--context", "2048", "--batch", "8", "--budget", "0.2", "--json",
             "--threads", "1", "--variants", "h2o", "--kv-memory", "0", "--steps", str(args.steps)]
    if args.compile:
        bench.append("--compile")
    perplexity = ["eval", "--task", "perplexity", "--model", args.model, "--text", args.text, "--tokens",
                  str(args.tokens), "--budget", "0.2", "--policies", "h2o", "--json", "--threads", "1"]
    rows = []
    for dtype in args.dtypes.split(","):
        cpu_ms = {(route, compiled): [] for route in ROUTE_ENV for compiled in (False, True)}
        for turn in range(args.whole_rounds):
            for route in (("kernel", "torch") if turn % 2 == 0 else ("torch", "kernel")):
                for result in _cli(route, *bench, "--dtype", dtype)["results"]:
                    cpu_ms[route, result["compiled"]].append(result["cpu_ms_per_step"])
        steps = {}
        for compiled in (False, True):
            got = {route: cpu_ms[route, compiled] for route in ROUTE_ENV}
            if all(got.values()):
                medians = {route: round(statistics.median(v), 2) for route, v in got.items()}
                steps["compiled" if compiled else "eager"] = {
                    "cpu_ms_per_step": got, "median_cpu_ms_per_step": medians,
                    "speedup": round(medians["torch"] / medians["kernel"], 3)}
        ppl = {route: _cli(route, *perplexity, "--dtype", dtype)["results"][0]["perplexity"] for route in ROUTE_ENV}
        rows.append({"dtype": dtype, "steps": steps, "perplexity": {k: round(v, 4) for k, v in ppl.items()},
                     "perplexity_same_to_3_decimals": round(ppl["kernel"], 3) == round(ppl["torch"], 3)})
        print(rows[-1], file=sys.stderr)
    return {"model": args.model, "threads": 1, "context": 2048, "batch": 8, "budget": 0.2, "rounds": args.whole_rounds,
            "variant": attention_ops.variant_name(), "text": Path(args.text).name, "tokens": args.tokens,
            "routes": {"kernel": "the C attention kernel (default)", "torch": "H2OCHAT_CPU_ATTENTION=0"},
            "rows": rows}


def chunk_rows(rounds: int, threads: int) -> list[dict]:
    """Median ms of a prompt chunk's attention (one row, SmolLM2's heads) on the torch route and through the kernel,
    as ``measure`` takes turns, without and with a recall tier's rest column (one more logit and value per query
    row); CPU time at one thread, wall time at more (``measure(wall=True)``)."""
    kernel = attention_ops._loaded()[0]
    heads, group, dim = 3, 3, 64
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for slots, q_len in ((1638, 512), (1638, 64), (512, 512)):
            for with_rest in (False, True):
                g = torch.Generator().manual_seed(0)
                query = torch.randn(1, heads, group, q_len, dim, generator=g).to(dtype)
                keys, values = (torch.randn(1, heads, slots, dim, generator=g).to(dtype) for _ in range(2))
                index = torch.arange(slots).expand(1, heads, slots).contiguous()
                new_keys, new_values = (torch.randn(1, heads, q_len, dim, generator=g).to(dtype) for _ in range(2))
                rest = ((torch.randn(1, heads, group, q_len, generator=g),
                         torch.randn(1, heads, group, q_len, dim, generator=g)) if with_rest else None)
                args = (query, keys, values, index, new_keys, new_values, None, 0.125, torch.zeros(1, heads, slots))
                calls = {"torch": lambda: reference.attend_with_scores(*args, rest=rest),
                         "kernel": lambda: attention_ops._call(kernel, *args, 1.0, threads, rest)}
                micros = measure(calls, rounds, wall=threads > 1)
                rows.append({"dtype": str(dtype).removeprefix("torch."), "slots": slots, "chunk_tokens": q_len,
                             "rest": with_rest, "median_ms": {k: round(v / 1000, 2) for k, v in micros.items()},
                             "speedup_over_torch": round(micros["torch"] / micros["kernel"], 2)})
                print(rows[-1], file=sys.stderr)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--slots", type=int, default=1638)
    parser.add_argument("--out")
    parser.add_argument("--routed", action="store_true", help="whole steps and perplexity, routed or not")
    parser.add_argument("--chunks", action="store_true", help="a prompt chunk: the torch route and the kernel")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--whole-rounds", type=int, default=2, help="--routed: bench runs per route and dtype")
    parser.add_argument("--steps", type=int, default=10, help="--routed: timed steps per bench run")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--text", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="--chunks: compute threads (above 1: wall time)")
    args = parser.parse_args()
    if args.chunks:
        torch.set_num_threads(args.threads)
        emit({"threads": args.threads, "clock": "cpu" if args.threads == 1 else "wall", "rounds": args.rounds,
              "variant": attention_ops.variant_name(), "rows": chunk_rows(args.rounds, args.threads)}, args.out,
             what="A prompt chunk's attention with its H2O scores: the torch route against the C kernel")
        return 0
    if args.routed:
        emit(whole_steps(args), args.out, what="Whole decode steps and perplexity with the CPU attention kernel "
             "routed (the default) against the torch route (H2OCHAT_CPU_ATTENTION=0), side by side")
        return 0
    torch.set_num_threads(1)
    rows, met = [], True
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (8, 1):
            micros = measure(routes(step(batch, args.slots, dtype)), args.rounds)
            kernels = {k: v for k, v in micros.items() if k not in ("torch", "routed")}
            best = min(kernels, key=kernels.get) if kernels else None
            speedup = {k: round(micros["torch"] / v, 2) for k, v in kernels.items()}
            if batch == 8:
                met = met and best is not None and speedup[best] >= TARGET
            rows.append({"dtype": str(dtype).removeprefix("torch."), "batch": batch, "kv_heads": 3, "group": 3,
                         "slots": args.slots, "head_dim": 64, "median_cpu_us": micros, "speedup_over_torch": speedup,
                         "best": best})
            print(rows[-1], file=sys.stderr)
    emit({"threads": 1, "rounds": args.rounds, "target": f"best variant >= {TARGET}x the torch route at 8 rows, "
          "bf16 and fp32", "met": met, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
