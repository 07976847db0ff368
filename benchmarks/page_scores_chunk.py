"""CPU time of a prompt chunk's page scores for the exact selector (the keys themselves, bf16), one thread:
the torch reference (``recall_reference.page_scores``: fp32 copies of the keys, the [M, T] dots, two
maxima) against the C kernel's route for many queries (``native.page_best``: blocks of 16 keys laid out by
channel pairs, VDPBF16PS), and the C ``top_pages`` a chunk's choice calls. A 300-token chunk of a
3-query-head group is 900 queries a KV head; keys are the leading slots of a bigger store (a view, as the
digest scores them). The ways take turns call by call so the machine's load falls on all alike; the
answers are compared (largest difference against the reference, fp32 sums in another order).

    taskset -c 1 python benchmarks/page_scores_chunk.py --out benchmarks/results_page_scores_chunk_s54.json

--decode: a decode step's few queries (a group of 1-5 query heads, 8 rows: what ``DecodeChoice`` scores
over a served bucket's store) on every variant of the recall kernels this CPU runs, side by side (``--dtype
float32``: fp32 queries and keys, which every variant scores by vectors of 8 floats): page_best and top_pages,
with the keys in the caches (``warm``: the call before, another C way's, left them there) and from memory
(``cold``: 128 MiB read before each call, as a served step's other layers and weights evict them).

    taskset -c 1 python benchmarks/page_scores_chunk.py --decode --out benchmarks/results_page_scores_decode_s54.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h2ochat_kernels import dispatch  # noqa: E402
from h2ochat_kernels import recall_reference as ref  # noqa: E402
from h2ochat_kernels.cpu import recall_ops as native  # noqa: E402
from h2ochat_kernels.cpu import variants  # noqa: E402
from json_report import emit  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def inputs(batch: int, heads: int, queries: int, tokens: int, dim: int, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    store = torch.randn(batch, heads, 2 * tokens, dim, generator=g).to(dtype)
    keys = store[:, :, :tokens]  # (strided: the store's leading slots)
    q = torch.randn(batch, heads, queries, dim, generator=g).to(dtype)
    return q, keys, torch.ones(batch, heads, tokens, dtype=torch.bool)


def timed(ways, repeats: int, before=None) -> dict[str, float]:
    """Median milliseconds of a call of each way, over ``repeats`` rounds of the ways taking turns
    (``before``: called, untimed, before each call)."""
    spent = {name: [] for name in ways}
    for way in ways.values():
        way()  # warm up
    for _ in range(repeats):
        for name, way in ways.items():
            if before:
                before()
            start = time.perf_counter()
            way()
            spent[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(times) * 1e3, 4) for name, times in spent.items()}


def variant_kernels() -> dict[str, native.Kernels]:
    """Every variant of the recall kernels this CPU runs and the install built, bound and checked, best first."""
    found = {}
    for variant in variants.of("recall"):
        if dispatch.cpu_runs(variant):
            kernels, _ = native._loaded(variant)
            if kernels is not None:
                found[variant.name] = kernels
    return found


def decode_rows(args) -> list[dict]:
    """--decode: each (queries, tokens), warm and cold, every variant side by side (the C ways taking turns among
    themselves: the torch reference's fp32 copies would evict the keys of the way after it, so it is timed on
    its own)."""
    kernels_of = variant_kernels()
    best = next(iter(kernels_of))
    flush = torch.ones(128 << 20, dtype=torch.uint8)
    rows = []
    for queries in args.queries:
        for tokens in args.tokens:
            q, keys, valid = inputs(args.batch, args.heads, queries, tokens, args.dim, DTYPES[args.dtype])
            count = torch.full((args.batch, args.heads), tokens)
            ways = {}
            for name, kernels in kernels_of.items():
                ways[name] = lambda kernels=kernels: native._call_page_best(kernels, q, keys, valid, args.page)
            for name, kernels in kernels_of.items():
                ways[f"{name}_top_pages"] = lambda kernels=kernels: native._call_top_pages(kernels, q, keys, count,
                                                                                           args.page, args.frames)
            torch_way = {"torch": lambda: ref.page_scores(q, keys, None, None, valid, args.page)}
            reference = torch_way["torch"]()
            row = {"queries": queries, "tokens": tokens,
                   "largest_difference": {name: float((ways[name]() - reference).abs().max()) for name in kernels_of},
                   "same_top_pages": {name: torch.equal(ways[f"{name}_top_pages"](), ref.top_pages(reference, args.frames))
                                      for name in kernels_of}}
            for caches, before in (("warm", None), ("cold", lambda: int(flush.view(torch.int64).sum()))):
                ms = {**timed(ways, args.repeats, before), **timed(torch_way, args.repeats, before)}
                row[caches] = {"ms": ms, "speedup_over_torch": {name: round(ms["torch"] / ms[name], 2) for name in kernels_of},
                               "against_the_best_variant": {name: round(ms[name] / ms[best], 2) for name in kernels_of}}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def chunk_rows(args) -> list[dict]:
    """Each (queries, tokens): the torch reference against the C route."""
    rows = []
    for queries in args.queries:
        for tokens in args.tokens:
            q, keys, valid = inputs(args.batch, args.heads, queries, tokens, args.dim)
            count = torch.full((args.batch, args.heads), tokens)
            ways = {"torch": lambda: ref.page_scores(q, keys, None, None, valid, args.page),
                    "c": lambda: native.page_best(q, keys, valid, args.page),
                    "c_top_pages": lambda: native.top_pages(q, keys, count, args.page, args.frames)}
            reference = ways["torch"]()
            gap = float((ways["c"]() - reference).abs().max())
            same_pages = torch.equal(ways["c_top_pages"](), ref.top_pages(reference, args.frames))
            ms = timed(ways, args.repeats)
            # the dots' VDPBF16PS count (16 products of pairs each) a millisecond: against the core's ~1 a cycle
            dots = args.batch * args.heads * queries * tokens * -(-args.dim // 2) / 16
            rows.append({"queries": queries, "tokens": tokens, "ms": ms, "speedup": round(ms["torch"] / ms["c"], 2),
                         "c_vdpbf16ps_per_ns": round(dots / (ms["c"] * 1e6), 2), "largest_difference": gap,
                         "same_top_pages": same_pages})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode", action="store_true", help="a decode step's few queries, every variant side by side")
    parser.add_argument("--queries", type=int, nargs="+", help="M a KV head (900; --decode: 1 2 3 4 5)")
    parser.add_argument("--tokens", type=int, nargs="+", help="T, the scored slots (512 1024 4096; --decode: 512 2048)")
    parser.add_argument("--heads", type=int, default=3, help="KV heads")
    parser.add_argument("--batch", type=int, help="rows (1; --decode: 8)")
    parser.add_argument("--dim", type=int, default=64, help="head dim")
    parser.add_argument("--page", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="(--decode) queries and keys: bf16, or fp32 (--dtype auto's on a CPU without native bf16)")
    parser.add_argument("--frames", type=int, default=16, help="pages top_pages chooses")
    parser.add_argument("--repeats", type=int, help="rounds of the ways (15; --decode: 31)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    defaults = ([1, 2, 3, 4, 5], [512, 2048], 8, 31) if args.decode else ([900], [512, 1024, 4096], 1, 15)
    for name, default in zip(("queries", "tokens", "batch", "repeats"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    torch.set_num_threads(1)
    if not native.available():
        print(f"no recall kernel: {native.why_not()}", file=sys.stderr)
        return 1
    rows = decode_rows(args) if args.decode else chunk_rows(args)
    report = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": 1,
              "affinity": sorted(os.sched_getaffinity(0)),
              "shapes": {"batch": args.batch, "kv_heads": args.heads, "head_dim": args.dim, "page": args.page,
                         "dtype": args.dtype,
                         "frames": args.frames, "repeats": args.repeats},
              "command": " ".join(["python benchmarks/page_scores_chunk.py", *(argv or sys.argv[1:])]),
              "route": dispatch.cpu_route("recall")[0].name, "rows": rows}
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
