"""CPU time of ``kernels.reference.attend_with_scores`` with the logits query-major [M, S + Q] (the
decode step's layout) against keys-major [S + Q, M] (what full prompt chunks run, issue 35), and of a
bf16 decode step multiplying its bf16 slots as they are against converting them to fp32, one thread,
the two taking turns call by call so the machine's load falls on both alike. SmolLM2-135M's shapes:
3 KV heads, groups of 3, head dim 64; slots full (the server's default 1,638) or not.

    python benchmarks/attention_layout.py --out benchmarks/results_attention_layout.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h2ochat_kernels import reference  # noqa: E402

SHAPES = [  # (batch, new tokens, slots)
    (1, 512, 1638), (1, 370, 1638), (1, 300, 1638), (1, 128, 1638), (1, 64, 1638),  # a chat's turn, slots full
    (1, 512, 1000), (1, 300, 1000), (1, 370, 800), (1, 512, 512),  # slots still filling
    (8, 1, 1638), (1, 1, 1638),  # decode steps (query-major either way)
]


def case(batch: int, q_len: int, slots: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    kv_heads, group, dim = 3, 3, 64
    tensors = dict(
        query=torch.randn(batch, kv_heads, group, q_len, dim, generator=g).to(dtype),
        cache_keys=torch.randn(batch, kv_heads, slots, dim, generator=g).to(dtype),
        cache_values=torch.randn(batch, kv_heads, slots, dim, generator=g).to(dtype),
        slot_token_index=torch.arange(slots).expand(batch, kv_heads, slots).contiguous(),
        new_keys=torch.randn(batch, kv_heads, q_len, dim, generator=g).to(dtype),
        new_values=torch.randn(batch, kv_heads, q_len, dim, generator=g).to(dtype),
        new_valid=None, scale=dim ** -0.5)
    return lambda: reference.attend_with_scores(**tensors, scores=torch.zeros(batch, kv_heads, slots))


def timed_with(name: str, value, call) -> float:
    """CPU seconds of ``call`` with ``reference.<name>`` set to ``value`` (put back after)."""
    chosen = getattr(reference, name)
    setattr(reference, name, value)
    try:
        started = time.process_time()
        call()
        return time.process_time() - started
    finally:
        setattr(reference, name, chosen)


def timed(call, keys_major: bool) -> float:
    return timed_with("KEYS_MAJOR_MIN_TOKENS", 2 if keys_major else 1 << 30, call)


def timed_bf16(call, native: bool) -> float:
    return timed_with("_multiplies_bf16_slots", reference._multiplies_bf16_slots if native else lambda *a: False, call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=6, help="calls per layout and shape (more for decode)")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch, q_len, slots in SHAPES:
            call = case(batch, q_len, slots, dtype)
            calls = args.calls * (10 if q_len == 1 else 1)
            spent = {"query_major": 0.0, "keys_major": 0.0}
            for _ in range(calls):
                spent["query_major"] += timed(call, False)
                spent["keys_major"] += timed(call, True)
            row = {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "new_tokens": q_len, "slots": slots,
                   **{f"{name}_ms": round(1e3 * s / calls, 2) for name, s in spent.items()},
                   "query_major_over_keys_major": round(spent["query_major"] / spent["keys_major"], 3)}
            if dtype == torch.bfloat16 and q_len == 1:
                native = converted = 0.0
                for _ in range(calls):
                    converted += timed_bf16(call, False)
                    native += timed_bf16(call, True)
                row.update(bf16_slots_via_fp32_ms=round(1e3 * converted / calls, 2),
                           bf16_slots_native_ms=round(1e3 * native / calls, 2),
                           via_fp32_over_native=round(converted / native, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv, "threads": 1, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
