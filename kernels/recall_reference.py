"""Page scoring for recall, plain torch: the semantics the Triton kernel (``triton_recall``) must equal.

Cold keys are digested per token as ``codes`` [B, H, T, D] with a per-token ``scale`` and ``offset``
[B, H, T] (key ~ codes * scale + offset): low-bit codes, or the keys themselves with scale 1 and
offset 0. Tokens are laid out in pages of ``page`` consecutive slots; ``valid`` [B, H, T] marks the
slots that hold a token. A page's score is the best q.k over its valid tokens and over the M queries
that read the KV head ([B, H, M, D]: the group's query heads times the step's new tokens);
a page without a valid token scores -inf.
"""

from __future__ import annotations

import torch


def page_scores(queries: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                valid: torch.Tensor, page: int) -> torch.Tensor:
    """[B, H, M, D], [B, H, T, D], [B, H, T] x3 -> [B, H, T // page] (T a multiple of ``page``)."""
    batch, heads, tokens, _ = codes.shape
    q = queries.float()
    # q . (c * s + o) = s * (q . c) + o * sum(q): the codes are never expanded to fp32 keys
    dots = torch.einsum("bhmd,bhtd->bhmt", q, codes.float()) * scale.float().unsqueeze(2)
    dots = dots + offset.float().unsqueeze(2) * q.sum(-1, keepdim=True)
    best = dots.amax(dim=2).masked_fill(~valid, float("-inf"))
    return best.view(batch, heads, tokens // page, page).amax(dim=-1)


def top_pages(scores: torch.Tensor, count: int) -> torch.Tensor:
    """[B, H, N] -> [B, H, k] page numbers, best first; -1 where fewer than k pages hold a token."""
    values, pages = scores.topk(min(count, scores.shape[-1]), dim=-1)
    return pages.masked_fill(values == float("-inf"), -1)
