"""CPU time of ``kernels.reference.attend_with_scores`` with a chunk's logits query-major [M, S + Q] at
once (the decode step's layout) against blocked (``blocked_chunk.attend_blocked``: ``CHUNK_BLOCK`` new
tokens at a time, what CPU prompt chunks run; also at blocks of 32 and 128), and of a
bf16 decode step multiplying its bf16 slots as they are against converting them to fp32, and of a bf16
decode step over W of C slot columns read three ways (``width`` rows: the view of the first W as it is,
that view copied to one block first, and all C columns with the empty ones masked:
``reference.attends_every_column``), one thread, the variants taking turns call by call so the
machine's load falls on all alike. SmolLM2-135M's shapes: 3 KV heads, groups of 3, head dim 64; slots
full (the server's default 1,638) or not.

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
from h2ochat_kernels import blocked_chunk, reference  # noqa: E402
from json_report import write  # noqa: E402

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


def timed_with(name: str, value, call, module=reference) -> float:
    """CPU seconds of ``call`` with ``module.<name>`` set to ``value`` (put back after)."""
    chosen = getattr(module, name)
    setattr(module, name, value)
    try:
        started = time.process_time()
        call()
        return time.process_time() - started
    finally:
        setattr(module, name, chosen)


def timed(call, block: int | None) -> float:
    """CPU seconds of ``call`` blocked by ``block`` new tokens, or query-major (None)."""
    if block is None:
        return timed_with("BLOCKED_MIN_TOKENS", 1 << 30, call, blocked_chunk)
    return timed_with("CHUNK_BLOCK", block, call, blocked_chunk)


BLOCKS = {"blocked": blocked_chunk.CHUNK_BLOCK, "blocked_32": 32, "blocked_128": 128}


def timed_bf16(call, native: bool) -> float:
    return timed_with("_multiplies_bf16_slots", reference._multiplies_bf16_slots if native else lambda *a: False, call)


BF16 = torch.zeros(1, dtype=torch.bfloat16)  # (what attends_every_column reads of the slots: dtype and device)
WIDTHS = [(batch, used) for batch in (1, 8) for used in (400, 1000, 1100, 1500)]  # of 1,638 columns


def width_case(batch: int, used: int, columns: int = 1638):
    """A bf16 decode step over the first ``used`` of ``columns`` slot columns, as the three calls to time."""
    g = torch.Generator().manual_seed(0)
    kv_heads, group, dim = 3, 3, 64
    full = dict(cache_keys=torch.randn(batch, kv_heads, columns, dim, generator=g).bfloat16(),
                cache_values=torch.randn(batch, kv_heads, columns, dim, generator=g).bfloat16(),
                slot_token_index=torch.arange(columns).masked_fill(torch.arange(columns) >= used, -1)
                .expand(batch, kv_heads, columns).contiguous())
    view = {name: tensor[:, :, :used] for name, tensor in full.items()}
    rest = dict(query=torch.randn(batch, kv_heads, group, 1, dim, generator=g).bfloat16(),
                new_keys=torch.randn(batch, kv_heads, 1, dim, generator=g).bfloat16(),
                new_values=torch.randn(batch, kv_heads, 1, dim, generator=g).bfloat16(), new_valid=None, scale=dim ** -0.5)

    def call(slots, width):
        return lambda: reference.attend_with_scores(**slots, **rest, scores=torch.zeros(batch, kv_heads, width))

    return {"view": call(view, used), "copied": call(view, used), "every_column": call(full, columns)}


def width_rows(calls: int) -> list[dict]:
    rows = []
    for batch, used in WIDTHS:
        variants = width_case(batch, used)
        spent = dict.fromkeys(variants, 0.0)
        for _ in range(calls):
            spent["view"] += timed_with("_contiguous", lambda slots: slots, variants["view"])
            spent["copied"] += timed_with("_contiguous", reference._contiguous, variants["copied"])
            spent["every_column"] += timed_with("_contiguous", reference._contiguous, variants["every_column"])
        row = {"width": True, "dtype": "bfloat16", "batch": batch, "new_tokens": 1, "slots_in_use": used, "columns": 1638,
               **{f"{name}_ms": round(1e3 * s / calls, 3) for name, s in spent.items()},
               "chosen": "every_column" if reference.attends_every_column(1, used, 1638, BF16) else "copied"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=6, help="calls per layout and shape (more for decode)")
    parser.add_argument("--out")
    parser.add_argument("--width-only", action="store_true", help="only the width rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = width_rows(args.calls * 20)
    for dtype in (() if args.width_only else (torch.float32, torch.bfloat16)):
        for batch, q_len, slots in SHAPES:
            call = case(batch, q_len, slots, dtype)
            calls = args.calls * (10 if q_len == 1 else 1)
            blocks = BLOCKS if q_len > 1 else {}  # (a decode step is query-major either way)
            spent = dict.fromkeys(["query_major", *blocks], 0.0)
            for _ in range(calls):
                spent["query_major"] += timed(call, None)
                for name, block in blocks.items():
                    spent[name] += timed(call, block)
            row = {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "new_tokens": q_len, "slots": slots,
                   **{f"{name}_ms": round(1e3 * s / calls, 2) for name, s in spent.items()}}
            if blocks:
                row["query_major_over_blocked"] = round(spent["query_major"] / spent["blocked"], 3)
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
        write({"argv": sys.argv, "threads": 1, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
