"""Page scoring for recall, plain torch: the semantics the Triton kernel (``triton_recall``) must equal.

Cold keys are digested per token as b-bit ``codes`` with a per-token ``scale`` and ``offset`` [B, H, T]
(key ~ codes * scale + offset), or kept as the keys themselves (``bits`` None, scale and offset None).
Codes are packed ``8 // bits`` to a byte in a channel-blocked layout (``pack_codes``): [B, H, T, W]
with W = ceil(D / f), byte j holding channels j, j + W, j + 2W, ... at bit offsets 0, b, 2b, ...; so
block i of every token is one shift and one mask of the packed row, and q . k is the sum over the f
blocks of q's block i . code block i (nothing is concatenated or expanded to D floats).

Tokens are laid out in pages of ``page`` consecutive slots; ``valid`` [B, H, T] marks the slots that
hold a token. A page's score is the best q.k over its valid tokens and over the M queries that read
the KV head ([B, H, M, D]: the group's query heads times the step's new tokens); a page without a
valid token scores -inf.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def codes_per_byte(bits: int | None) -> int:
    """f: how many codes one byte holds (bits None: one value per element, the keys themselves)."""
    if bits is None:
        return 1
    if not 1 <= bits <= 8:
        raise ValueError(f"codes of 1-8 bits, got {bits}")
    return 8 // bits


def packed_width(dim: int, bits: int | None) -> int:
    """W: elements per token of D channels packed (D padded up to a multiple of f)."""
    return -(-dim // codes_per_byte(bits))


def code_block(packed: torch.Tensor, bits: int | None, block: int) -> torch.Tensor:
    """Block ``block`` of the packed codes [..., W]: channels block*W .. block*W + W - 1 (uint8)."""
    if bits is None or packed.is_floating_point():
        return packed
    # no shift for the first block, no mask for the top one of unsigned bytes: a decode step unpacks
    # int4 slots every layer, where each op costs more than its few bytes
    shifted = packed >> (block * bits) if block else packed
    if packed.dtype == torch.uint8 and (block + 1) * bits == 8:
        return shifted
    return shifted & ((1 << bits) - 1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., D] uint8 below 2**bits -> [..., W] uint8 in the channel-blocked layout."""
    per_byte, width = codes_per_byte(bits), packed_width(codes.shape[-1], bits)
    if per_byte == 1:
        return codes.clone()
    pad = per_byte * width - codes.shape[-1]
    blocks = (F.pad(codes, (0, pad)) if pad else codes).unflatten(-1, (per_byte, width))
    packed = blocks[..., 0, :] | (blocks[..., 1, :] << bits)  # (a new tensor: two ops for int4)
    for i in range(2, per_byte):
        packed |= blocks[..., i, :] << (i * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """``pack_codes``'s inverse: [..., W] -> [..., D] uint8."""
    blocks = [code_block(packed, bits, i) for i in range(codes_per_byte(bits))]
    codes = torch.cat(blocks, dim=-1) if len(blocks) > 1 else blocks[0]
    return codes if codes.shape[-1] == dim else codes[..., :dim]


def page_scores(queries: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                offset: torch.Tensor | None, valid: torch.Tensor, page: int, bits: int | None = None) -> torch.Tensor:
    """queries [B, H, M, D], codes [B, H, T, W] (packed ``bits``-bit codes, or the keys themselves:
    bits None or float codes), scale, offset (None: 1 and 0) and valid [B, H, T] -> [B, H, T // page]
    (T a multiple of ``page``)."""
    if scale is not None and queries.shape[2] >= queries.shape[-1] // 2:
        # many queries (a prompt chunk's): the keys once as floats (T x D work) and one product beat the
        # scale and offset applied to every query's dots (M x T): 3.0-4.3x at 900 queries over 1-4K tokens,
        # faster from 36 on, slower at 24 and below (benchmarks/results_page_scores.json, head dim 64); a
        # decode step's few queries keep the codes
        dots = queries.float() @ dequantized_keys(codes, scale, offset, bits, queries.shape[-1]).transpose(-1, -2)
    else:
        dots = code_dots(queries, codes, scale, offset, bits)
    best = dots.amax(dim=2).masked_fill(~valid, float("-inf"))
    batch, heads, tokens = valid.shape
    return best.view(batch, heads, tokens // page, page).amax(dim=-1)


def code_dots(queries: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None,
              bits: int | None) -> torch.Tensor:
    """q . k of every query and token [B, H, M, T] straight from the packed codes: the codes are never
    expanded to fp32 keys, q . (c * s + o) = s * (q . c) + o * sum(q)."""
    width = codes.shape[-1]
    per_byte = 1 if codes.is_floating_point() else codes_per_byte(bits)
    q = queries.float()
    blocks = F.pad(q, (0, per_byte * width - q.shape[-1])).unflatten(-1, (per_byte, width))
    dots = sum(torch.einsum("bhmw,bhtw->bhmt", blocks[..., i, :], code_block(codes, bits, i).float())
               for i in range(per_byte))
    if scale is not None:
        dots = dots * scale.float().unsqueeze(2) + offset.float().unsqueeze(2) * q.sum(-1, keepdim=True)
    return dots


def dequantized_keys(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int | None,
                     dim: int) -> torch.Tensor:
    """The keys [B, H, T, D] fp32 the packed codes stand for: codes * scale + offset."""
    values = codes.float() if codes.is_floating_point() else unpack_codes(codes, bits, dim).float()
    return values * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)


def top_pages(scores: torch.Tensor, count: int) -> torch.Tensor:
    """[B, H, N] -> [B, H, k] page numbers, best first; -1 where fewer than k pages hold a token."""
    values, pages = scores.topk(min(count, scores.shape[-1]), dim=-1)
    return pages.masked_fill(values == float("-inf"), -1)
