"""How fast one core reads memory, and how fast a one-row decode step's linears stream their weights
(issue 35's single-stream target): a decode step at one row reads every weight once, so its linears
cannot beat the weight bytes over the core's read bandwidth.

Measured on one thread, each figure the best of ``--repeats``:
- the core's read bandwidth: an fp32 sum, an fp32 dot and MKL's fp32 matrix-vector product over 256 MB
  (far past the caches), and a copy (read and write);
- SmolLM2-135M's linear shapes as the server runs them (bf16, packed once for oneDNN:
  ``h2ochat.engine.packed_linears``), each through enough distinct weights that none is in a cache when
  it is read (what a decode step sees), at 1 and 8 rows; and the same with weight-only int8
  (``torch._weight_int8pack_mm``, half the bytes), the cheapest way to read fewer weight bytes torch has;
- the floor those give a one-row decode step of SmolLM2's 269 MB of bf16 weights;
- what a mixed prefill/decode step (one forward for a prompt chunk and the running rows, vLLM's chunked
  prefill) would save in the linears, the only part the two share: a step's linears at 8 rows plus at a
  380-token chunk (a chat turn) against at 388 rows.

    python benchmarks/weight_streaming.py --out benchmarks/results_weight_streaming.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from json_report import write

# SmolLM2-135M: hidden 576, MLP 1,536, 3 KV heads of 64, 30 layers, a tied 49,152-token head
LINEARS = {"q_proj/o_proj": (576, 576, 60), "k_proj/v_proj": (192, 576, 60), "gate_proj/up_proj": (1536, 576, 60),
           "down_proj": (576, 1536, 30), "lm_head": (49152, 576, 1)}
COLD_BYTES = 256 << 20  # distinct weights per timing: past any cache


def best_seconds(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def bandwidth(repeats: int) -> dict:
    x = torch.randn(COLD_BYTES // 4)
    y = torch.empty_like(x)
    half = x.numel() // 2
    matrix, vector = x.view(-1, 4096), torch.randn(4096)
    gb = x.numel() * 4 / 1e9
    return {
        "fp32_sum_gb_per_s": round(gb / best_seconds(x.sum, repeats), 2),
        "fp32_dot_gb_per_s": round(gb / best_seconds(lambda: torch.dot(x[:half], x[half:]), repeats), 2),
        "mkl_fp32_matrix_vector_gb_per_s": round(gb / best_seconds(lambda: torch.mv(matrix, vector), repeats), 2),
        "copy_read_and_write_gb_per_s": round(2 * gb / best_seconds(lambda: y.copy_(x), repeats), 2),
    }


def int8_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.float().abs().amax(1).clamp_min(1e-8) / 127
    return (weight.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.bfloat16()


def linear_rows(repeats: int, row_counts=(1, 8), int8: bool = True) -> list[dict]:
    rows = []
    for name, (out_features, in_features, per_step) in LINEARS.items():
        weight_bytes = out_features * in_features * 2
        copies = max(2, COLD_BYTES // weight_bytes)
        weights = [(torch.randn(out_features, in_features) * 0.02).bfloat16() for _ in range(copies)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        quantized = [int8_weights(w) for w in weights] if int8 else []
        del weights
        for batch in row_counts:
            x = torch.randn(batch, in_features).bfloat16()
            bf16_s = best_seconds(lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                           for w in packed], repeats) / copies
            rows.append({"linear": name, "out": out_features, "in": in_features, "per_decode_step": per_step,
                         "rows": batch, "bf16_packed_us": round(1e6 * bf16_s, 1),
                         "bf16_packed_gb_per_s": round(weight_bytes / bf16_s / 1e9, 2)})
            if int8:
                int8_s = best_seconds(lambda: [torch.ops.aten._weight_int8pack_mm(x, w, s) for w, s in quantized],
                                      repeats) / copies
                rows[-1].update(int8_weights_us=round(1e6 * int8_s, 1), bf16_over_int8=round(bf16_s / int8_s, 3))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    read = bandwidth(args.repeats)
    print(json.dumps(read), flush=True)
    rows = linear_rows(args.repeats)
    step_bytes = sum(row["out"] * row["in"] * 2 * row["per_decode_step"] for row in rows if row["rows"] == 1)
    linears_ms = step_linears_ms(rows, 1)
    fastest_read = max(read.values())
    floor = {"weight_bytes_per_decode_step": step_bytes,
             "linears_ms_per_one_row_step_bf16_packed": round(linears_ms, 2),
             "weights_ms_at_the_fastest_read": round(step_bytes / fastest_read / 1e6, 2),
             "decode_tokens_per_s_if_only_the_linears": round(1e3 / linears_ms, 1)}
    print(json.dumps(floor), flush=True)
    mixed = mixed_step(rows, args.repeats)
    print(json.dumps(mixed), flush=True)
    if args.out:
        write({"argv": sys.argv, "threads": 1, "read_bandwidth": read, "linears": rows,
               "one_row_decode_floor": floor, "mixed_step_linears": mixed}, args.out)


def step_linears_ms(rows: list[dict], rows_of: int) -> float:
    """A step's linears (every layer's and the head) at ``rows_of`` rows, from ``linear_rows``' entries."""
    return sum(row["bf16_packed_us"] * row["per_decode_step"] for row in rows if row["rows"] == rows_of) / 1e3


def mixed_step(measured: list[dict], repeats: int, decode_rows: int = 8, chunk: int = 380) -> dict:
    """A step's linears at ``decode_rows`` (from ``measured``), at a ``chunk``-token prompt chunk and at both
    in one forward: what a mixed step would save (the attention is not shared)."""
    rows = linear_rows(repeats, (chunk, chunk + decode_rows), int8=False)
    decode = step_linears_ms(measured, decode_rows)
    prefill, both = step_linears_ms(rows, chunk), step_linears_ms(rows, chunk + decode_rows)
    return {"decode_rows": decode_rows, "chunk_tokens": chunk, "decode_step_linears_ms": round(decode, 2),
            "chunk_linears_ms": round(prefill, 2), "mixed_step_linears_ms": round(both, 2),
            "saved_per_mixed_step_ms": round(decode + prefill - both, 2)}


if __name__ == "__main__":
    main()
