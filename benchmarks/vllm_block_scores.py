"""The vLLM plugin's decode score pass: the C kernel (keys read in place) against the torch route (a gather copy).

One layer's pass for R requests that each decode one token, at SmolLM2-135M's heads (9 query heads over 3 KV
heads, head dim 64) in vLLM's CPU cache layout, each request holding ``--kept`` blocks of ``--block-size`` tokens
(the budget's). The two routes run alternately, the median of each reported with their ratio; their results are
checked equal first (tests/test_block_scores.py holds them to it on every variant).
usage: vllm_block_scores.py [--rows 8] [--kept 8] [--block-size 128] [--dtype float32] [--repeats 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch
from json_report import emit

from h2ochat_kernels.cpu import block_scores_ops

_SPEC = importlib.util.spec_from_file_location("h2ochat_vllm_scores",
                                               Path(__file__).resolve().parents[1] / "h2ochat_vllm" / "scores.py")
scores = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--kept", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kv_heads, heads, dim = 3, 9, 64
    generator = torch.Generator().manual_seed(0)
    num_blocks = args.rows * args.kept * 2
    kv_cache = torch.randn(num_blocks, kv_heads, args.block_size, 2 * dim, generator=generator).to(dtype)
    keys = scores.key_view(kv_cache)
    query = torch.randn(args.rows, heads, dim, generator=generator).to(dtype)
    blocks = torch.randperm(num_blocks, generator=generator)[: args.rows * args.kept].view(args.rows, args.kept)
    lens = torch.full((args.rows,), args.kept * args.block_size - args.block_size // 2, dtype=torch.long)
    routes = {"torch": lambda: scores.decode_block_scores(query, keys, blocks, lens, dim ** -0.5),
              "kernel": lambda: block_scores_ops.decode_block_scores(query, keys, blocks, lens, dim ** -0.5)}
    if routes["kernel"]() is None:
        raise SystemExit(f"the block score kernel does not run here: {block_scores_ops.why_not()}")
    torch.testing.assert_close(routes["kernel"](), routes["torch"](), rtol=1e-2 if dtype != torch.float32 else 1e-5,
                               atol=1e-2 if dtype != torch.float32 else 1e-6)
    times = {name: [] for name in routes}
    for _ in range(args.repeats):
        for name, run in routes.items():  # alternating: the machine's other load falls on both alike
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    emit({"shape": {"rows": args.rows, "kept_blocks": args.kept, "block_size": args.block_size, "kv_heads": kv_heads,
                    "query_heads": heads, "head_dim": dim, "dtype": args.dtype},
          "threads": torch.get_num_threads(), "variant": block_scores_ops.variant_name(), "repeats": args.repeats,
          "median_us": median, "torch_over_kernel": median["torch"] / median["kernel"]}, args.out)


if __name__ == "__main__":
    main()
