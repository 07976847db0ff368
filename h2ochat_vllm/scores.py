"""The attention one step's queries give each KV block of one request, in plain torch.

H2O's score: the softmax probability each cached token receives, summed over the step's queries and
over the query heads (every KV head here; the sum over heads is what a block-granular policy can use,
since all KV heads of a token share one block). Accumulated in float32 whatever the KV dtype.
"""

from __future__ import annotations

import torch


def block_scores(query: torch.Tensor, key_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int,
                 scale: float) -> torch.Tensor:
    """query [n, H, D] (the step's queries of one request, rotated: RoPE applied), key_cache
    [num_blocks, Hkv, block_size, D], blocks [k] the request's kept blocks in order, seq_len the
    tokens they hold (the step's own included, last) -> [k] float32, the attention each block got.
    Query i sits at place seq_len - n + i and sees the places up to it (causal)."""
    n, heads, dim = query.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    keys = key_cache.index_select(0, blocks).transpose(0, 1).reshape(kv_heads, -1, dim)[:, :seq_len]
    group = heads // kv_heads
    # rows ordered (query head in the group, query): one matmul per KV head, no repeated keys
    q = query.float().view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)
    logits = torch.matmul(q, keys.float().transpose(1, 2)) * scale  # [Hkv, G*n, S]
    if n > 1:
        place = torch.arange(seq_len - n, seq_len).repeat(group)  # each row's own place
        logits.masked_fill_(torch.arange(seq_len).view(1, 1, -1) > place.view(1, -1, 1), float("-inf"))
    column = torch.softmax(logits, dim=-1).sum(dim=(0, 1))  # [S]
    padded = torch.zeros(blocks.numel() * block_size, dtype=torch.float32)
    padded[:seq_len] = column
    return padded.view(-1, block_size).sum(dim=1)
