"""The attention one step's queries give each KV block, in plain torch.

H2O's score: the softmax probability each cached token receives, summed over the step's queries and
over the query heads (every KV head here; the sum over heads is what a block-granular policy can use,
since all KV heads of a token share one block). The logits are computed in the KV cache's dtype
(bf16 matmuls are several times faster on CPUs that have them; a float32 cache gives float32 logits),
the softmax and every sum in float32.

The keys are read as vLLM's CPU attention stores them (its ``vec`` and ``vec16`` kernels: a block's keys for one
KV head channel-major, channel d's ``block_size`` tokens side by side, then the values token-major):
``key_view`` gives them as [num_blocks, Hkv, D, block_size]. These functions are the reference the C kernel
(``h2ochat_kernels.cpu.block_scores_ops``) is held to.
"""

from __future__ import annotations

import torch


def value_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU cache of a layer [num_blocks, Hkv, block_size, 2 * D] -> its values [num_blocks, Hkv,
    block_size, D], a view (token-major, after each block and head's keys)."""
    num_blocks, kv_heads, block_size, both = kv_cache.shape
    return kv_cache.view(num_blocks, kv_heads, 2, block_size, both // 2)[:, :, 1]


def key_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU cache of a layer [num_blocks, Hkv, block_size, 2 * D] -> its keys [num_blocks, Hkv, D,
    block_size], a view (each block and head holds D x block_size keys, channel-major, then its values)."""
    num_blocks, kv_heads, block_size, both = kv_cache.shape
    return kv_cache.view(num_blocks, kv_heads, 2, both // 2, block_size)[:, :, 0]


def grouped(query: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., n, H, D] -> [..., Hkv, G*n, D]: a KV head's query heads side by side, no repeated keys."""
    *lead, n, heads, dim = query.shape
    group = heads // kv_heads
    q = query.to(dtype).reshape(*lead, n, kv_heads, group, dim).movedim(-4, -2)  # [..., Hkv, G, n, D]
    return q.reshape(*lead, kv_heads, group * n, dim)


def causal_bias(n: int, group: int) -> torch.Tensor:
    """[G*n, n] float32: -inf where a query of the step would see a later token of the step."""
    return torch.full((n, n), float("-inf")).triu(1).repeat(group, 1)


def block_scores(query: torch.Tensor, key_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int,
                 scale: float) -> torch.Tensor:
    """query [n, H, D] (the step's last n queries of one request, rotated: RoPE applied), key_cache
    [num_blocks, Hkv, D, block_size] (``key_view``), blocks [k] the request's kept blocks in order, seq_len the
    tokens they hold (the step's own included, last) -> [k] float32, the attention each block got.
    Query i sits at place seq_len - n + i and sees the places up to it (causal)."""
    n, heads, dim = query.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[3]
    keys = key_cache.index_select(0, blocks).permute(1, 2, 0, 3).reshape(kv_heads, dim, -1)[:, :, :seq_len]
    logits = torch.matmul(grouped(query, kv_heads, keys.dtype), keys).float()  # [Hkv, G*n, S]
    logits.mul_(scale)
    if n > 1:  # the step's own tokens, last: each query sees those up to itself
        logits[:, :, seq_len - n:] += causal_bias(n, heads // kv_heads)
    column = torch.softmax(logits, dim=-1).sum(dim=(0, 1))  # [S]
    padded = torch.zeros(blocks.numel() * block_size, dtype=torch.float32)
    padded[:seq_len] = column
    return padded.view(-1, block_size).sum(dim=1)


def decode_block_scores(query: torch.Tensor, key_cache: torch.Tensor, blocks: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """``block_scores`` for R requests that each decode one token, in one batch: query [R, H, D],
    blocks [R, k] (padded with any block id past each row's own), seq_lens [R] -> [R, k]."""
    rows, heads, dim = query.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[3]
    width = blocks.shape[1] * block_size
    keys = key_cache[blocks]  # [R, k, Hkv, D, bs], as the cache lays them out: no second copy
    q = grouped(query.unsqueeze(1), kv_heads, keys.dtype).unsqueeze(1)  # [R, 1, Hkv, G, D]
    logits = torch.matmul(q, keys).float()  # [R, k, Hkv, G, bs]: small
    logits = logits.permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, -1, width).mul_(scale)
    outside = torch.arange(width).view(1, -1) >= seq_lens.view(-1, 1)  # [R, width]: padding
    logits.masked_fill_(outside.view(rows, 1, 1, width), float("-inf"))
    column = torch.softmax(logits, dim=-1).sum(dim=(1, 2))  # [R, width]
    return column.view(rows, -1, block_size).sum(dim=-1)
