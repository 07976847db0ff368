"""What the torch attention paths share (``reference``'s query-major step, ``blocked_chunk``'s prompt
chunks): the logit a masked key gets, the empty slots' bias, the causal mask among the new tokens, and
per-token weights laid out by query row."""

from __future__ import annotations

import torch

# the logit of a key nobody may read: float32's min (not -inf), so a row with every key masked (a
# padding row) softmaxes to a uniform row instead of NaN
MASKED = torch.finfo(torch.float32).min


def empty_slot_bias(slot_token_index: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, S] fp32: ``MASKED`` for an empty slot (token index < 0), 0 for a held one: added to the
    logits in one op (a ``masked_fill`` over them costs ~5x that on the CPU)."""
    return torch.where(slot_token_index < 0, MASKED, 0.0)


def f32(t: torch.Tensor) -> torch.Tensor:
    """fp32 view of ``t`` (no op when it already is: every op counts in a CPU decode step)."""
    return t if t.dtype == torch.float32 else t.float()


def query_row_weights(weights: torch.Tensor, group: int) -> torch.Tensor:
    """[B, Q] per-token weights as [B, 1, G * Q, 1]: one per query row (the G heads of a token alike)."""
    batch, q_len = weights.shape
    return weights.view(batch, 1, 1, q_len).expand(batch, 1, group, q_len).reshape(batch, 1, group * q_len, 1)


def new_key_mask(new_valid: torch.Tensor | None, batch: int, q_len: int, device) -> torch.Tensor:
    """[B, 1, 1, Q, Q] bool: query row i may read new key j (causal, and j is not padding)."""
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    mask = causal.view(1, 1, 1, q_len, q_len)
    if new_valid is not None:
        mask = mask & new_valid.view(batch, 1, 1, 1, q_len)
    return mask


def rest_rows(rest, batch: int, kv_heads: int, start: int = 0, stop: int | None = None):
    """A recall tier's rest column (``reference.attend_with_scores``' ``rest``: logit [B, Hkv, G, Q], value
    [B, Hkv, G, Q, D]) for query tokens ``start:stop``, laid out by query row: ([B, Hkv, M, 1], [B, Hkv, M, D])."""
    logit, value = rest
    if start or stop is not None:  # (a decode step's whole rest: no view to make)
        logit, value = logit[:, :, :, start:stop], value[:, :, :, start:stop]
    logit = f32(logit) if logit.shape[3] == 1 else f32(logit).reshape(batch, kv_heads, -1, 1)  # (Q = 1: by row already)
    return logit, f32(value).reshape(batch, kv_heads, -1, value.shape[-1])


def softmax_beside_rest(blocks: list[torch.Tensor], rest, batch: int, kv_heads: int, start: int = 0,
                        stop: int | None = None) -> tuple[torch.Tensor, tuple | None]:
    """The softmax over the logit ``blocks`` [B, Hkv, M, W_i] side by side and, where a recall tier hands one,
    its rest column for query tokens ``start:stop`` (``rest_rows``), joined in the same op: (the probabilities
    of the W columns, and None or the rest's probability [B, Hkv, M, 1] and value [B, Hkv, M, D] for
    ``with_rest``). (A CPU decode step pays per op: the rest costs two, this join and ``with_rest``'s.)"""
    if rest is None:
        logits = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)
        return logits.softmax(dim=-1), None
    rest_logit, rest_value = rest_rows(rest, batch, kv_heads, start, stop)
    probs = torch.cat([*blocks, rest_logit], dim=-1).softmax(dim=-1)
    return probs[..., :-1], (probs[..., -1:], rest_value)


def with_rest(out: torch.Tensor, rest_part: tuple | None) -> torch.Tensor:
    """``out`` [B, Hkv, M, D] plus the rest's part (``softmax_beside_rest``'s: its probability times its value)."""
    return out if rest_part is None else torch.addcmul(out, *rest_part)
