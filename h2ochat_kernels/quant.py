"""Quantised KV slots: the one format the cache, the torch reference and the Triton kernels share.

Per token and KV head (one row of D channels), asymmetric min-max codes of ``bits`` bits:

    scale  = (max - min) / (2**bits - 1)        offset = min
    code   = round((x - offset) / scale), clamped to [0, 2**bits - 1], uint8
    x'     = code * scale + offset              (|x' - x| <= scale / 2, plus float rounding)

Scale and offset are float32 [...] (one per row, no trailing 1). int8 keeps one code a byte
([..., D]); int4 packs two codes a byte in ``recall_reference``'s channel-blocked layout
(``pack_codes``: byte j holds channel j in its low nibble and channel j + W in its high one,
W = ceil(D / 2)), the layout the recall page-score kernel already reads, so a decode kernel gets
channel d of a slot with one load, one shift and one mask.

Why the offset (asymmetric): measured on SmolLM2-135M (fp32, 30 layers, the keys after RoPE and
the values of the first 512 tokens of tinyshakespeare.txt), relative round-trip error
||x' - x|| / ||x||, asymmetric (this format) against symmetric (scale = max|x| / (2**(bits-1) - 1),
no offset):

                         int8 asym   int8 sym   int4 asym   int4 sym
    keys (after RoPE)      0.77 %      1.09 %     13.1 %      19.8 %
    keys, rotated          0.50 %      0.55 %      8.5 %      10.0 %   (int4 keys are stored rotated)
    values                 0.57 %      0.67 %      9.7 %      12.2 %

(benchmarks/quant_roundtrip.py, results_quant_roundtrip.json). Symmetric codes are 10-50 % worse
in every row, so the offset stays. A row's range is seldom centred on 0, and symmetric codes spend
levels on values beyond its min that it never takes; the offset costs 4 bytes a row.

``level_codes`` / ``level_values`` are the unpacked quantiser with the scale and offset kept as
[..., 1] in a chosen dtype: the recall digest's (``h2ochat.recall.selectors`` imports them as its
``quantize`` / ``dequantize``; it stores fp16 scales).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .recall_reference import pack_codes, packed_width, unpack_codes

BITS = {"int8": 8, "int4": 4}
# the per-slot tensors quantized slots keep beside the codes, by the names the cache and the CPU kernels use
SCALE_TENSORS = ("key_scale", "key_offset", "value_scale", "value_offset")

# A row whose channels are all equal has max == min: the scale is kept above 0 so the codes divide
# by something (they come out 0, and the row dequantises to its offset exactly).
_TINY_SCALE = 1e-12


class QuantSlots(NamedTuple):
    """What a quantised cache passes beside its codes to ``attend_with_scores``: the code width and
    the per-slot scale and offset of keys and values, each [B, Hkv, S] float32 (views of the slot
    buffers, like the codes)."""

    bits: int
    key_scale: torch.Tensor
    key_offset: torch.Tensor
    value_scale: torch.Tensor
    value_offset: torch.Tensor
    key_dim: int
    value_dim: int


def check_bits(bits: int) -> int:
    if bits not in BITS.values():
        raise ValueError(f"quantised slots take {sorted(BITS.values())} bits, got {bits}")
    return bits


def code_width(dim: int, bits: int) -> int:
    """Bytes of codes per row of ``dim`` channels: D for int8, ceil(D / 2) for int4."""
    return packed_width(dim, check_bits(bits))


def bytes_per_token(dim: int, bits: int) -> int:
    """Device bytes one token takes per KV head for keys (or for values): its codes plus a float32
    scale and a float32 offset."""
    return code_width(dim, bits) + 4 + 4


def level_codes(x: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked b-bit codes of ``x`` [..., D]: (codes uint8 [..., D], scale [..., 1], offset
    [..., 1]), scale and offset in ``dtype``. The codes are rounded against the scale and offset as
    stored, so a 16-bit scale and offset add no error beyond their own rounding."""
    levels = (1 << bits) - 1
    values = x.float()
    # few ops, in place where possible: the cache quantises every new token of every layer
    low, high = torch.aminmax(values, dim=-1, keepdim=True)
    if dtype != torch.float32:
        low = low.to(dtype)
        scale = ((high - low.float()) / levels).clamp_min_(_TINY_SCALE).to(dtype)
        # (clamped again: fp16 rounds a tiny scale to 0, where every code dequantises to the offset)
        codes = ((values - low.float()) / scale.float().clamp_min(_TINY_SCALE)).round_().clamp_(0, levels)
    else:
        scale = (high - low).div_(levels).clamp_min_(_TINY_SCALE)
        # x - min >= 0 exactly, and (max - min) / scale rounds to at most levels: no clamp needed
        codes = (values - low).div_(scale).round_()
    return codes.to(torch.uint8), scale, low


def level_values(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``level_codes``'s inverse in fp32: codes [..., D] with scale and offset broadcasting against them."""
    return codes.float() * scale.float() + offset.float()


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., code_width(D, bits)], scale float32 [...], offset float32 [...])."""
    codes, scale, offset = level_codes(x, check_bits(bits))
    if bits < 8:
        codes = pack_codes(codes, bits)
    return codes, scale.squeeze(-1), offset.squeeze(-1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, dim: int | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``quantize``'s inverse: codes [..., W], scale and offset [...] -> [..., dim] in ``dtype``
    (``dim`` None: every channel the codes hold, W * codes a byte)."""
    values = level_values(unpacked(codes, bits, dim), scale.unsqueeze(-1), offset.unsqueeze(-1))
    return values if values.dtype == dtype else values.to(dtype)


def unpacked(codes: torch.Tensor, bits: int, dim: int | None = None) -> torch.Tensor:
    """Codes [..., W] -> one code a byte [..., dim] (int8 codes are returned as they are)."""
    if check_bits(bits) < 8:
        return unpack_codes(codes, bits, dim if dim is not None else codes.shape[-1] * (8 // bits))
    if dim is not None and dim != codes.shape[-1]:
        raise ValueError(f"int8 codes of width {codes.shape[-1]} hold {codes.shape[-1]} channels, not {dim}")
    return codes


def dequantized_slots(cache_keys: torch.Tensor, cache_values: torch.Tensor, quant: QuantSlots,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots' keys and values [B, Hkv, S, D] from their codes (what the torch reference attends)."""
    keys = dequantize(cache_keys, quant.key_scale, quant.key_offset, quant.bits, quant.key_dim, dtype)
    values = dequantize(cache_values, quant.value_scale, quant.value_offset, quant.bits, quant.value_dim, dtype)
    return keys, values
