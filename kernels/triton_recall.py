"""Page scoring for recall in Triton: ``recall_reference.page_scores`` in one launch.

One program per (sequence, KV head, block of pages): it reads the block's codes once, scores them
against each of the M queries (M is small: the group's query heads times the step's tokens), keeps
the best per token, then the best per page. Codes of any dtype (uint8 low-bit codes, or 16/32-bit
keys with scale 1 and offset 0) are converted to fp32 in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import launch_guard, next_pow2


@triton.jit
def _page_scores_kernel(Q, C, S, O, V, Out, M, T, D, N,
                        sq_b, sq_h, sq_m, sc_b, sc_h, sc_t, ss_b, ss_h, sv_b, sv_h, so_b, so_h,
                        HEADS: tl.constexpr, PAGE: tl.constexpr, PAGES: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // HEADS
    h = bh % HEADS
    first = tl.program_id(1) * PAGES * PAGE
    tok = first + tl.arange(0, PAGES * PAGE)
    dim = tl.arange(0, BLOCK_D)
    in_t = tok < T
    codes = tl.load(C + b * sc_b + h * sc_h + tok[:, None] * sc_t + dim[None, :],
                    mask=in_t[:, None] & (dim[None, :] < D), other=0).to(tl.float32)
    scale = tl.load(S + b * ss_b + h * ss_h + tok, mask=in_t, other=0).to(tl.float32)
    offset = tl.load(O + b * ss_b + h * ss_h + tok, mask=in_t, other=0).to(tl.float32)
    valid = tl.load(V + b * sv_b + h * sv_h + tok, mask=in_t, other=0) != 0
    best = tl.full((PAGES * PAGE,), float("-inf"), tl.float32)
    for m in range(0, M):
        q = tl.load(Q + b * sq_b + h * sq_h + m * sq_m + dim, mask=dim < D, other=0).to(tl.float32)
        dots = tl.sum(codes * q[None, :], axis=1) * scale + offset * tl.sum(q, axis=0)
        best = tl.maximum(best, dots)
    best = tl.where(valid, best, float("-inf"))
    page_best = tl.max(tl.reshape(best, (PAGES, PAGE)), axis=1)
    page = tl.program_id(1) * PAGES + tl.arange(0, PAGES)
    tl.store(Out + b * so_b + h * so_h + page, page_best, mask=page < N)


def page_scores(queries: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                valid: torch.Tensor, page: int, pages_per_block: int = 4) -> torch.Tensor:
    """Same contract as ``recall_reference.page_scores``; ``page`` a power of two."""
    if page & (page - 1):
        raise ValueError(f"the Triton page scoring needs a power-of-two page size, got {page}")
    batch, heads, tokens, dim = codes.shape
    pages = tokens // page
    queries = queries.contiguous()
    codes, scale, offset = codes.contiguous(), scale.contiguous(), offset.contiguous()
    valid = valid.to(torch.uint8).contiguous()
    out = torch.empty(batch, heads, pages, dtype=torch.float32, device=codes.device)
    grid = (batch * heads, triton.cdiv(pages, pages_per_block))
    with launch_guard(codes):
        _page_scores_kernel[grid](
            queries, codes, scale, offset, valid, out, queries.shape[2], tokens, dim, pages,
            queries.stride(0), queries.stride(1), queries.stride(2), codes.stride(0), codes.stride(1), codes.stride(2),
            scale.stride(0), scale.stride(1), valid.stride(0), valid.stride(1), out.stride(0), out.stride(1),
            HEADS=heads, PAGE=page, PAGES=pages_per_block, BLOCK_D=max(16, next_pow2(dim)))
    return out
