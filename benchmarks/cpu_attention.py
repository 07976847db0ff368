"""Time of a decode step's attention with its H2O scores, per layer: the torch route (``reference.attend_with_scores``,
what ``H2OCHAT_CPU_KERNELS=none`` runs) against each variant of the C kernel this CPU runs
(``h2ochat_kernels.cpu.attention_ops``), side by side: the routes take turns call by call so the machine's load
falls on all alike, one thread, CPU time. Shapes of a served SmolLM2-135M step: 3 KV heads, groups of 3, head dim 64, 1,638
slots full (the server's default), 8 rows and 1, bf16 and fp32. The target: the best variant at least 2x the torch
route at 8 rows in both dtypes (the torch route was 47% of a served step; the kernel should take it under a quarter).

    python benchmarks/cpu_attention.py --out benchmarks/results_cpu_attention.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from json_report import emit  # noqa: E402

from h2ochat_kernels import dispatch, reference  # noqa: E402
from h2ochat_kernels.cpu import attention_ops, variants  # noqa: E402

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
        kernel, why = attention_ops._loaded_variant(variant)
        if kernel is None:
            print(f"{variant.name}: {why}", file=sys.stderr)
            continue
        calls[variant.name] = lambda kernel=kernel: attention_ops._call(kernel, *args, 1.0, 1)
    calls["routed"] = lambda: dispatch.Backend("torch").attend_with_scores(*args)
    return calls


def measure(calls: dict, rounds: int) -> dict:
    """Median CPU microseconds of each call over ``rounds`` turns (each route once a turn, after a warm-up): CPU time
    (one thread), not wall time, so that other jobs on a shared machine do not count."""
    times = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            started = time.process_time()
            call()
            times[name].append(time.process_time() - started)
    return {name: round(statistics.median(t) * 1e6, 1) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--slots", type=int, default=1638)
    parser.add_argument("--out")
    args = parser.parse_args()
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
