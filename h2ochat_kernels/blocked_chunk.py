"""A CPU prompt chunk's attention in blocks of its new tokens (``attend_blocked``): the layout
``reference.attend_with_scores`` runs for every unquantised CPU chunk (``runs_blocked``), with the same
semantics as its query-major path."""

from __future__ import annotations

import torch

from .attention_rows import MASKED, empty_slot_bias, f32, new_key_mask, query_row_weights, softmax_beside_rest, with_rest

# CPU prompt chunks of at least this many tokens run the blocked layout (``attend_blocked``)
BLOCKED_MIN_TOKENS = 2
# and this many of their new tokens at a time
CHUNK_BLOCK = 64


def runs_blocked(q_len: int, device: torch.device) -> bool:
    """Whether a step of ``q_len`` new tokens on ``device`` runs the blocked layout: a CPU prompt chunk.
    Measured on one thread (``benchmarks/results_attention_layout.json``, SmolLM2's shapes, fp32 and
    bf16 alike): 1.15-2.0x less CPU than the whole chunk's logits at 300-512 tokens over 512-1,638
    slots, 0.87-1.08x at 64-128 (no steady difference either way: taken too, one rule); `generate`'s
    prefill of 2,048 tokens in 512-token chunks 2.2x faster than the keys-major layout it replaces,
    the same tokens. Blocks of 32 or 128 tokens are within 10% of 64. A decode step (one token) has no
    block to make; a GPU's torch path (no Triton) keeps the whole chunk, not measured there."""
    return q_len >= BLOCKED_MIN_TOKENS and device.type == "cpu"


def attend_blocked(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, weights,
                   scale: float, block: int | None = None, rest=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt chunk's attention (Q > 1, unquantised slots), ``block`` of its new tokens at a time: the
    slots' and the new tokens' keys joined once in fp32 (a copy of S + Q keys), then per block one
    product for the logits, the masks (one add, which also scales), the softmax and the received
    attention, and one product for the output. A block's logits stay in the CPU's cache through
    those passes, where the whole chunk's (M x (S + Q) fp32: 40 MB for SmolLM2 at 512 tokens over
    1,500 slots) went to memory and back at each of them; and a block reads no new key after its
    last token; a recall tier's ``rest`` column (``reference.attend_with_scores``) joins each block's
    softmax. The same numbers as the query-major path up to fp32 rounding. Returns (output
    [B, Hkv, G, Q, D] fp32, the attention each key received [B, Hkv, S + Q], weighted by ``weights``)."""
    batch, kv_heads, group, q_len, head_dim = query.shape
    block = block or CHUNK_BLOCK
    slots = cache_keys.shape[2]
    keys = torch.cat([f32(cache_keys), f32(new_keys)], dim=2)
    values = torch.cat([f32(cache_values), f32(new_values)], dim=2)
    empty = empty_slot_bias(slot_token_index)
    bias = torch.cat([empty, empty.new_zeros(batch, kv_heads, q_len)], dim=2).unsqueeze(2)  # [B, Hkv, 1, S + Q]
    readable = new_key_mask(new_valid, batch, q_len, query.device)  # [B, 1, 1, Q, Q]
    out = torch.empty(batch, kv_heads, group, q_len, head_dim, dtype=torch.float32, device=query.device)
    received = torch.zeros(batch, kv_heads, slots + q_len, dtype=torch.float32, device=query.device)
    for start in range(0, q_len, block):
        end = min(start + block, q_len)
        width, tokens = slots + end, end - start
        rows = f32(query[:, :, :, start:end].reshape(batch, kv_heads, group * tokens, head_dim))
        logits = torch.add(bias[..., :width], torch.matmul(rows, keys[:, :, :width].transpose(-1, -2)), alpha=scale)
        logits[..., slots:].view(batch, kv_heads, group, tokens, end).masked_fill_(~readable[..., start:end, :end],
                                                                                  MASKED)
        probs, rest_part = softmax_beside_rest([logits], rest, batch, kv_heads, start, end)
        block_out = with_rest(torch.matmul(probs, values[:, :, :width]), rest_part)
        out[:, :, :, start:end] = block_out.view(batch, kv_heads, group, tokens, head_dim)
        if weights is not None:
            probs = probs * query_row_weights(weights[:, start:end], group)
        received[..., :width] += probs.sum(dim=2)
    return out, received
