"""CPU time of recall's page scoring (``recall_reference.page_scores``) two ways, side by side, one
thread: q . k straight from the packed codes (``code_dots``: the scale and offset applied to every
query's dots) against the keys dequantised once and one product (``dequantized_keys``). The first
costs M x T work beyond the product, the second T x D, so ``page_scores`` takes the second from M >= D / 2
queries on (a prompt chunk: the group's query heads times its tokens). SmolLM2-135M's shapes (3 KV heads,
head dim 64, 4-bit codes, pages of 16); the two ways take turns call by call so the machine's load
falls on both alike, and the answers are compared.

    python benchmarks/page_scores.py --out benchmarks/results_page_scores.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h2ochat_kernels import recall_reference as ref  # noqa: E402
from json_report import emit  # noqa: E402

KV_HEADS, DIM, PAGE, BITS = 3, 64, 16, 4
QUERIES = (3, 12, 24, 36, 48, 96, 384, 900)  # a decode step's group (3) up to a 300-token chunk's 900
TOKENS = (1024, 2048, 4096)  # the stage-2 candidates' tokens: up to 256 pages of 16


def inputs(queries: int, tokens: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, KV_HEADS, queries, DIM, generator=g)
    codes = ref.pack_codes(torch.randint(0, 1 << BITS, (1, KV_HEADS, tokens, DIM), generator=g, dtype=torch.uint8), BITS)
    scale = (torch.rand(1, KV_HEADS, tokens, generator=g) * 0.2).half()
    offset = torch.randn(1, KV_HEADS, tokens, generator=g).half()
    return q, codes, scale, offset


def from_codes(q, codes, scale, offset):
    return ref.code_dots(q, codes, scale, offset, BITS).amax(dim=2)


def from_keys(q, codes, scale, offset):
    return (q @ ref.dequantized_keys(codes, scale, offset, BITS, DIM).transpose(-1, -2)).amax(dim=2)


def timed(ways, args, seconds: float) -> dict[str, float]:
    """Milliseconds a call of each way, the ways taking turns until ``seconds`` have passed."""
    spent = {name: 0.0 for name in ways}
    calls = 0
    for way in ways.values():
        way(*args)  # warm up
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or calls < 3:
        for name, way in ways.items():
            start = time.perf_counter()
            way(*args)
            spent[name] += time.perf_counter() - start
        calls += 1
    return {name: round(total / calls * 1e3, 4) for name, total in spent.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="time per shape")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ways = {"codes": from_codes, "dequantised": from_keys}
    rows = []
    for tokens in TOKENS:
        for queries in QUERIES:
            case = inputs(queries, tokens)
            gap = float((from_codes(*case) - from_keys(*case)).abs().max())
            ms = timed(ways, case, args.seconds)
            rows.append({"queries": queries, "tokens": tokens, "ms": ms,
                         "codes_over_dequantised": round(ms["codes"] / ms["dequantised"], 3),
                         "page_scores_takes": "dequantised" if queries >= DIM // 2 else "codes",
                         "largest_difference": gap})
            print(json.dumps(rows[-1]), file=sys.stderr)
    report = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": 1,
              "shapes": {"kv_heads": KV_HEADS, "head_dim": DIM, "page": PAGE, "bits": BITS},
              "command": "python benchmarks/page_scores.py" + (f" --out {args.out}" if args.out else ""),
              "rows": rows}
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
