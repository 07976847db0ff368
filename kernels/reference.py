"""Plain-torch definitions of what every kernel in this package computes.

These functions are the semantics: the Triton kernels must equal them, and the CPU path of the
application runs them directly. Shapes follow one convention throughout:

    B  sequences in the batch        Hkv  KV heads          G  query heads per KV head (GQA group)
    S  cache slots scanned            Q    new tokens this step (1 when decoding)      D  head dim

A slot is valid when its ``slot_token_index`` is >= 0; empty slots and padding hold -1.
"""

from __future__ import annotations

import torch

_MASKED = torch.finfo(torch.float32).min


def attend_with_scores(
    query: torch.Tensor,
    cache_keys: torch.Tensor,
    cache_values: torch.Tensor,
    slot_token_index: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    new_valid: torch.Tensor | None,
    scale: float,
    scores: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of Q new queries over S cached slots plus the Q new tokens, with H2O scoring.

    query            [B, Hkv, G, Q, D]
    cache_keys/values [B, Hkv, S, D]     (may be a strided view of a larger slot buffer)
    slot_token_index [B, Hkv, S] int     (< 0: slot holds nothing attendable)
    new_keys/values  [B, Hkv, Q, D]
    new_valid        [B, Q] bool or None (False: padding token; None: all real)
    scores           [B, Hkv, S] float32, updated in place: += attention probability each slot
                     received, summed over the G query heads and the real query rows.

    New tokens attend causally among themselves. Padding keys receive no attention; padding query
    rows add nothing to any score. Returns (output [B, Hkv, G, Q, D] in query's dtype,
    new_scores [B, Hkv, Q] float32: the same column sums for the new tokens).
    """
    batch, kv_heads, group, q_len, head_dim = query.shape
    rows = query.reshape(batch, kv_heads, group * q_len, head_dim).float()

    cache_logits = torch.matmul(rows, cache_keys.float().transpose(-1, -2)) * scale
    cache_logits = cache_logits.masked_fill((slot_token_index < 0).unsqueeze(2), _MASKED)
    new_logits = torch.matmul(rows, new_keys.float().transpose(-1, -2)) * scale
    new_logits = new_logits.view(batch, kv_heads, group, q_len, q_len)
    new_logits = new_logits.masked_fill(~_new_key_mask(new_valid, batch, q_len, query.device), _MASKED)
    new_logits = new_logits.view(batch, kv_heads, group * q_len, q_len)

    probs = torch.cat([cache_logits, new_logits], dim=-1).softmax(dim=-1)
    slots = cache_keys.shape[2]
    cache_probs, new_probs = probs[..., :slots], probs[..., slots:]
    out = torch.matmul(cache_probs, cache_values.float()) + torch.matmul(new_probs, new_values.float())

    if new_valid is not None:
        real_rows = new_valid.view(batch, 1, 1, q_len).expand(batch, 1, group, q_len)
        real_rows = real_rows.reshape(batch, 1, group * q_len, 1).to(probs.dtype)
        cache_probs, new_probs = cache_probs * real_rows, new_probs * real_rows
    scores += cache_probs.sum(dim=2)
    new_scores = new_probs.sum(dim=2)
    return out.view(batch, kv_heads, group, q_len, head_dim).to(query.dtype), new_scores


def _new_key_mask(new_valid: torch.Tensor | None, batch: int, q_len: int, device) -> torch.Tensor:
    """[B, 1, 1, Q, Q] bool: query row i may read new key j (causal, and j is not padding)."""
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    mask = causal.view(1, 1, 1, q_len, q_len)
    if new_valid is not None:
        mask = mask & new_valid.view(batch, 1, 1, 1, q_len)
    return mask


def evict_and_insert(
    priority: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    slot_token_index: torch.Tensor,
    slot_position: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    new_score: torch.Tensor,
    new_token_index: torch.Tensor,
    new_position: torch.Tensor,
) -> torch.Tensor:
    """Decode-step eviction: per (sequence, KV head) overwrite the lowest-priority slot in place.

    priority          [B, Hkv, S] float: higher = keep. Callers give -inf to empty/padding slots (so
                      they go first) and +inf to protected ones (recent window, sinks).
    keys/values       [B, Hkv, S, D]; scores [B, Hkv, S] float32;
    slot_token_index, slot_position [B, Hkv, S] int64
    new_key/new_value [B, Hkv, 1, D]; new_score [B, Hkv] float32;
    new_token_index, new_position [B] int64 (the same for every head of a sequence)

    Ties go to the lowest slot index. Returns the token index each (sequence, head) dropped
    [B, Hkv] (-1 where the chosen slot held nothing).
    """
    batch, kv_heads, _, head_dim = keys.shape
    slot = priority.argmin(dim=-1, keepdim=True)
    dropped = slot_token_index.gather(2, slot).squeeze(2)
    row_slot = slot.unsqueeze(-1).expand(batch, kv_heads, 1, head_dim)
    keys.scatter_(2, row_slot, new_key.to(keys.dtype))
    values.scatter_(2, row_slot, new_value.to(values.dtype))
    scores.scatter_(2, slot, new_score.unsqueeze(-1))
    slot_token_index.scatter_(2, slot, new_token_index.view(batch, 1, 1).expand(batch, kv_heads, 1))
    slot_position.scatter_(2, slot, new_position.view(batch, 1, 1).expand(batch, kv_heads, 1))
    return dropped
