"""Round-trip error of the quantised KV slots' format on real keys and values (SmolLM2-135M, fp32):
asymmetric min-max codes (``h2ochat_kernels.quant``, scale and offset per token and KV head) against
symmetric ones (scale = max|x| / (2**(bits-1) - 1), no offset), int8 and int4, keys as the cache
holds them (after RoPE; for int4 also turned by the spreading rotation, as the cache side stores
int4 keys) and values. Writes JSON.

    OMP_NUM_THREADS=1 python benchmarks/quant_roundtrip.py --tokens 512 --out benchmarks/results_quant_roundtrip.json
"""

from __future__ import annotations

import argparse
import json

import torch

from h2ochat.loading.models import load
from h2ochat.recall.selectors import rotated
from h2ochat_kernels import quant
from json_report import write


def symmetric(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Dequantised symmetric codes of x [..., D]: round(x / scale) in [-(2**(b-1)-1), 2**(b-1)-1]."""
    levels = (1 << (bits - 1)) - 1
    scale = (x.abs().amax(dim=-1, keepdim=True) / levels).clamp_min(1e-12)
    return (x / scale).round().clamp(-levels, levels) * scale


def asymmetric(x: torch.Tensor, bits: int) -> torch.Tensor:
    return quant.dequantize(*quant.quantize(x, bits), bits, x.shape[-1])


def errors(x: torch.Tensor, approx: torch.Tensor) -> dict:
    diff = approx - x
    return {"relative": float(diff.norm() / x.norm()),
            "row_relative_mean": float((diff.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)).mean()),
            "max_abs": float(diff.abs().max())}


@torch.no_grad()
def layer_tensors(text: str, tokens: int):
    """(keys, values) [layers, Hkv, T, D] of the first ``tokens`` tokens of ``text``, as a full cache holds them."""
    loaded = load("smollm2-135m", "cpu", "float32")
    model = loaded.model
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([loaded.tokenizer.encode(text)[:tokens]])
    cache = model(input_ids=ids, use_cache=True).past_key_values
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return keys.float(), values.float()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--text", default="/work/shared/data/tinyshakespeare.txt")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keys, values = layer_tensors(open(args.text, encoding="utf-8").read(), args.tokens)
    rows = []
    for name, tensor in (("keys", keys), ("keys rotated", rotated(keys)), ("values", values)):
        for bits in (8, 4):
            row = {"tensor": name, "bits": bits, "asymmetric": errors(tensor, asymmetric(tensor, bits)),
                   "symmetric": errors(tensor, symmetric(tensor, bits))}
            row["symmetric_over_asymmetric"] = row["symmetric"]["relative"] / row["asymmetric"]["relative"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"model": "smollm2-135m", "dtype": "float32", "text": args.text, "tokens": args.tokens,
              "shape": list(keys.shape), "rows": rows}
    write(result, args.out)


if __name__ == "__main__":
    main()
