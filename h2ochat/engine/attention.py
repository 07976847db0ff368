"""The ``h2o`` attention implementation registered with transformers.

Load a model with ``attn_implementation="h2o"`` (or call ``use_h2o_attention(model)``). With an
``H2OCache`` the attention of every layer runs over the cache's slots plus the new tokens and
feeds the scores back to the cache; without one (a plain forward with ``use_cache=False``) it is
ordinary causal attention through sdpa, so one loaded model serves both.

How the attention finds its cache layer, first match wins:
1. ``h2o_cache=`` passed to ``model(...)`` (h2ochat's own loop does, the compiled step too; every
   family forwards it);
2. the cache whose ``update`` last parked keys on this thread (``kv.layer.last_update``: transformers'
   own ``generate()``, which passes no extra keyword; every family calls ``update`` just before its
   attention).
The cache checks the hand-over both ways: a step whose keys no attention picked up raises at the next
``update``, and keys that changed between ``update`` and the attention raise here.

transformers hands a custom attention function whatever mask its registered mask function built.
Ours (``new_token_mask``) keeps only what the cache cannot know: which of the new tokens are
padding, as a [B, Q] bool tensor (None when none are). Causality and slot validity are the
cache's business.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from ..kv import last_update

NAME = "h2o"


def new_token_mask(batch_size, q_length, kv_length=None, attention_mask=None, **kwargs):
    """Mask function for ``h2o``: the padding of the new tokens only, [B, Q] bool, or None."""
    if attention_mask is None:
        return None
    new_tokens = attention_mask[:, -q_length:].to(torch.bool)
    if not bool(new_tokens.all()):
        # padding after a real token ends a row: right padding. A row with no real token yet is a chunk
        # of a long left padding (prefill feeds a prompt in chunks): fine.
        if bool((~new_tokens[:, -1] & new_tokens.any(dim=1)).any()):
            raise ValueError("right-padded batches are not supported (the last token of a row would be padding): "
                             "pad on the left (tokenizer.padding_side = 'left')")
        return new_tokens
    return None


def _pending_cache(h2o_cache):
    return h2o_cache if h2o_cache is not None else last_update.take()


def h2o_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, h2o_cache=None,
                  **kwargs):
    """query [B, Hq, Q, D], key/value [B, Hkv, Q, D] (new tokens only) -> ([B, Q, Hq, D], None)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache = _pending_cache(h2o_cache)
    if cache is None:
        return _uncached_attention(module, query, key, value, attention_mask, scale, dropout, **kwargs)
    out = cache.attend(module.layer_idx, query, key, value, attention_mask, scale)
    batch, kv_heads, group, q_len, head_dim = out.shape
    return out.reshape(batch, kv_heads * group, q_len, head_dim).transpose(1, 2).contiguous(), None


def _uncached_attention(module, query, key, value, new_valid, scale, dropout, **kwargs):
    if key.shape[2] != query.shape[2]:
        raise ValueError("h2o attention keeps its keys in an H2OCache; pass one (or use_cache=False)")
    mask = None
    if new_valid is not None:
        q_len = query.shape[2]
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
        # a padding row with nothing to read would give NaN: let it read itself
        mask = (causal & new_valid[:, None, None, :]) | torch.eye(q_len, dtype=torch.bool, device=query.device)
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scale, is_causal=mask is None, **kwargs)


def register() -> None:
    AttentionInterface.register(NAME, h2o_attention)
    AttentionMaskInterface.register(NAME, new_token_mask)


def use_h2o_attention(model) -> None:
    """Switch an already loaded model to the h2o attention implementation."""
    register()
    model.set_attn_implementation(NAME)


register()
