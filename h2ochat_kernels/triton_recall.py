"""Page scoring for recall in Triton: ``recall_reference.page_scores`` in one launch.

One program per (sequence, KV head, block of pages): it reads the block's packed codes once, scores
them against each of the M queries (the group's query heads times the step's tokens), keeps the best
per token, then the best per page. The packed tile [T, W] is unpacked once, in registers, into its
``PER_BYTE`` channel blocks [T, f, W] (one shift per block and a mask; f is 8 // bits, a power of
two), before the loop over the queries: each query is read as the same [f, W] blocks and dotted
with them, so nothing is unpacked again per query. Float codes (the keys themselves) are one block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import launch_guard, next_pow2
from .recall_reference import codes_per_byte


@triton.jit
def _page_scores_kernel(Q, C, S, O, V, Out, M, T, D, W, N,
                        sq_b, sq_h, sq_m, sc_b, sc_h, sc_t, ss_b, ss_h, sv_b, sv_h, so_b, so_h,
                        HEADS: tl.constexpr, PAGE: tl.constexpr, PAGES: tl.constexpr, BLOCK_W: tl.constexpr,
                        BITS: tl.constexpr, PER_BYTE: tl.constexpr, SCALED: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // HEADS
    h = bh % HEADS
    first = tl.program_id(1) * PAGES * PAGE
    tok = first + tl.arange(0, PAGES * PAGE)
    col = tl.arange(0, BLOCK_W)
    block = tl.arange(0, PER_BYTE)
    in_t = tok < T
    tile = tl.load(C + b * sc_b + h * sc_h + tok[:, None] * sc_t + col[None, :],
                   mask=in_t[:, None] & (col[None, :] < W), other=0)
    if BITS > 0:  # block i of byte j: channel i * W + j, at bit offset i * BITS (shifts on 32-bit lanes)
        codes = ((tile.to(tl.int32)[:, None, :] >> (block * BITS)[None, :, None]) & ((1 << BITS) - 1))
        codes = codes.to(tl.float32)
    else:
        codes = tile.to(tl.float32)[:, None, :]
    channel = block[:, None] * W + col[None, :]  # [PER_BYTE, BLOCK_W]
    in_d = (col[None, :] < W) & (channel < D)
    if SCALED:
        scale = tl.load(S + b * ss_b + h * ss_h + tok, mask=in_t, other=0).to(tl.float32)
        offset = tl.load(O + b * ss_b + h * ss_h + tok, mask=in_t, other=0).to(tl.float32)
    valid = tl.load(V + b * sv_b + h * sv_h + tok, mask=in_t, other=0) != 0
    best = tl.full((PAGES * PAGE,), float("-inf"), tl.float32)
    for m in range(0, M):
        q = tl.load(Q + b * sq_b + h * sq_h + m * sq_m + channel, mask=in_d, other=0).to(tl.float32)
        dots = tl.sum(tl.sum(codes * q[None, :, :], axis=2), axis=1)
        if SCALED:  # q . (c * s + o) = s * (q . c) + o * sum(q)
            dots = dots * scale + offset * tl.sum(tl.sum(q, axis=1), axis=0)
        best = tl.maximum(best, dots)
    best = tl.where(valid, best, float("-inf"))
    page_best = tl.max(tl.reshape(best, (PAGES, PAGE)), axis=1)
    page = tl.program_id(1) * PAGES + tl.arange(0, PAGES)
    tl.store(Out + b * so_b + h * so_h + page, page_best, mask=page < N)


def page_scores(queries: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                offset: torch.Tensor | None, valid: torch.Tensor, page: int, bits: int | None = None,
                pages_per_block: int = 4) -> torch.Tensor:
    """Same contract as ``recall_reference.page_scores``; ``page`` a power of two."""
    if page & (page - 1):
        raise ValueError(f"the Triton page scoring needs a power-of-two page size, got {page}")
    batch, heads, tokens, width = codes.shape
    bits = None if codes.is_floating_point() else bits
    pages = tokens // page
    # strided over batch, head and slot (a store's leading slots are a view, not copied), unit stride
    # along a row; scale and offset are read with one set of strides
    queries = queries.contiguous()
    codes = codes if codes.stride(-1) == 1 else codes.contiguous()
    valid = valid.to(torch.uint8).contiguous()
    scaled = scale is not None
    if scaled and (scale.stride(-1) != 1 or offset.stride() != scale.stride()):
        scale, offset = scale.contiguous(), offset.contiguous()
    # (unscaled: any tensor stands in for the pointers the kernel never reads)
    scale, offset = (scale, offset) if scaled else (valid, valid)
    out = torch.empty(batch, heads, pages, dtype=torch.float32, device=codes.device)
    grid = (batch * heads, triton.cdiv(pages, pages_per_block))
    with launch_guard(codes):
        _page_scores_kernel[grid](
            queries, codes, scale, offset, valid, out, queries.shape[2], tokens, queries.shape[3], width, pages,
            queries.stride(0), queries.stride(1), queries.stride(2), codes.stride(0), codes.stride(1), codes.stride(2),
            scale.stride(0), scale.stride(1), valid.stride(0), valid.stride(1), out.stride(0), out.stride(1),
            HEADS=heads, PAGE=page, PAGES=pages_per_block, BLOCK_W=max(16, next_pow2(width)),
            BITS=bits or 0, PER_BYTE=codes_per_byte(bits), SCALED=scaled)
    return out
