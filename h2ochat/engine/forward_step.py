"""One forward of new tokens through a model and its ``H2OCache``: the step every path shares
(prefill chunks, the eager decode step, and the compiled decode step's eager fallback).

The cache hands out the step's position ids (``H2OCache.position_ids``, re-numbering first when the
model's position limit is near); the model encodes the tokens at them and every layer records them.
"""

from __future__ import annotations

from typing import Callable

import torch

from .attention import NAME as H2O_ATTENTION
from ..kv import AttentionMismatchError, H2OCache
from ..model_shape import cache_argument

# (cache, tokens [B] or [B, 1], active=None) -> next-token logits [B, V]; ``active`` [B] bool leaves
# the rows that are False out of the step (they write nothing: ``H2OCache.position_ids``)
Decode = Callable[..., torch.Tensor]


def require_h2o_attention(model) -> None:
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != H2O_ATTENTION:
        raise AttentionMismatchError(f"the model runs {implementation!r} attention; an H2OCache needs "
                                     "attn_implementation='h2o' (h2ochat.engine.attention.use_h2o_attention(model))")


def forward(model, cache: H2OCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            logits_to_keep: int = 0, active: torch.Tensor | None = None) -> torch.Tensor:
    """One forward of ``input_ids`` [B, Q] through the cache; returns logits [B, Q or kept, V].
    ``active`` [B] bool (a decode step): the rows that are False write nothing (their logits are
    meaningless)."""
    batch, q_len = input_ids.shape
    new_valid = None
    if attention_mask is not None and not bool(attention_mask.all()):
        new_valid = attention_mask.to(torch.bool)
    require_h2o_attention(model)
    position_ids = cache.position_ids(batch, q_len, new_valid, device=input_ids.device, active=active)
    kwargs = {cache_argument(model): cache, "h2o_cache": cache}
    with torch.inference_mode():
        out = model(
            input_ids=input_ids,
            attention_mask=new_valid.long() if new_valid is not None else None,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
    return out.logits


class EagerDecode:
    """The decode step as a plain forward: ``EagerDecode(model)(cache, tokens, active=None)`` -> logits [B, V]."""

    def __init__(self, model):
        self.model = model

    def __call__(self, cache: H2OCache, tokens: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        return forward(self.model, cache, tokens.view(-1, 1), logits_to_keep=1, active=active)[:, -1]
