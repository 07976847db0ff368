"""The rest (``--recall-rest``): the cold pages a step does not recall still count in its attention.

Recall attends the hot slots, the recalled pages and the staging page; every other cold token drops out
of the softmax, and with it its share of the attention. On the pass key at 512 device slots (~3,600
tokens) that loss tips near ties the full cache wins: recall found 71 of the full cache's 82 keys over
180 held-out trials, and the misses answered with prose where the full cache started the number.

The rest puts them back as one more attention column per query row (``rest_column``), as the masked
reference defines it (``masked.MaskedRecall(rest=True)``): each unrecalled page of the cold store weighs
what its tokens would draw, the logsumexp of their logits, and holds their mean value; the column's
logit is the pages' logsumexp, its value the pages' means weighed by their shares. Only the values
inside a page are approximated: with pages of one token the attention is the full cache's. The column
is no slot: it scores nothing, and the policy ranks only what the slots hold.

This module is the torch route (a GPU's, a compiled step's, a CPU's without the C kernel, a cache whose cold
keys must be turned after a re-numbering): every step reads every cold key and value (``ColdStore.pages`` of
all its pages) and multiplies the step's queries with the keys, several times h2o's step
(results_recall_rest_cost_*.json). Where the choice's C call runs (a CPU, a bf16 or fp32 model: either build
of ``recall_kernel.c``), a decode step's or a prompt chunk's rest comes from it instead
(``native_choice.DecodeChoice``: the q.k the exact choice computes anyway, each full page's mean kept once,
``PageMeans``): the same column up to the order of its sums, faster. Which steps attend the rest is the
mode's alone (``RecallConfig.rest_attended``), whichever route computes it. An eager step only (a compiled
graph reads no host count).
"""

from __future__ import annotations

import torch

from ..rotary import Rotary
from .cold_store import ColdStore


def rest_column(cold: ColdStore, frame_page: torch.Tensor, queries: torch.Tensor, scale: float,
                rotary: Rotary | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rest column for ``queries`` [B, H, G, Q, D] (the step's, the layer's attention scale): logit
    [B, H, G, Q] fp32 (-inf where a row and head hold no unrecalled page) and value [B, H, G, Q, D] fp32,
    what ``attend_with_scores(rest=...)`` takes; None while no row has a cold token. ``frame_page``
    [B, H, F]: the pages the recall frames hold (-1: none), left out."""
    batch, heads, group, q_len, dim = queries.shape
    page = cold.page
    pages = int(cold.held()[1].max())  # (one host read: 0 while no row has a cold token)
    if pages == 0:
        return None
    page_ids = torch.arange(pages, device=frame_page.device).expand(batch, heads, pages)
    keys, values, token_index, _ = cold.pages(page_ids, rotary)  # [B, H, N*P, ...], -1 where absent
    recalled = (page_ids.unsqueeze(-1) == frame_page.unsqueeze(-2)).any(-1)  # [B, H, N]
    member = (token_index >= 0).view(batch, heads, pages, page) & ~recalled.unsqueeze(-1)  # [B, H, N, P]
    rows = cold.scored_queries(queries).float().reshape(batch, heads, group * q_len, dim)  # (as the C rest's q.k)
    logits = torch.matmul(rows, keys.float().transpose(-1, -2)) * scale  # [B, H, M, N*P]
    logits = logits.view(batch, heads, group * q_len, pages, page)
    logits = logits.masked_fill(~member.unsqueeze(2), float("-inf"))
    weight = logits.logsumexp(dim=-1)  # [B, H, M, N]: what each page's tokens would draw
    count = member.sum(dim=-1, keepdim=True)  # [B, H, N, 1]
    summed = (values.float().view(batch, heads, pages, page, -1) * member.unsqueeze(-1)).sum(dim=3)
    mean = summed / count.clamp(min=1)  # [B, H, N, Dv]
    logit = weight.logsumexp(dim=-1)  # [B, H, M]
    share = (weight - logit.unsqueeze(-1)).exp().nan_to_num(0.0)  # (-inf - -inf where no page is: 0)
    value = torch.matmul(share, mean)  # [B, H, M, Dv]
    return logit.view(batch, heads, group, q_len), value.view(batch, heads, group, q_len, -1)
