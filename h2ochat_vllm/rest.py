"""The rest in prompt chunks: a chunk's last queries attend every cold block, not only the recalled ones.

Recall gives a step the few cold blocks its queries score best. A prompt chunk's last queries (a pass
key's question among them: the one that answers is the chunk's last) can need a block their choice missed,
so they attend, besides the row's kept blocks, every block the worker keeps cold: the attention those rows
would get from the whole cache, less the blocks dropped at the memory bound (as h2ochat's own recall attends
the rest of its cold pages in prompt chunks; here token by token, exactly). The chunk's other queries attend
the kept blocks and the recalled ones, which keeps a long prompt's cost near the budget's: only the last
``recall_queries`` rows read every cold key. It runs in torch after vLLM's kernel and replaces its output for
those rows, by blocks of queries so that the logits stay small. The cold blocks live in host memory; only
the kept blocks and the recall slots count in the budget.

The same probabilities give those queries' H2O scores for the kept blocks (a cold block's attention goes to
no block's score, as a recalled one's).
"""

from __future__ import annotations

import torch

from .scores import causal_bias, grouped, key_view, value_view

QUERY_BLOCK = 256  # queries per pass: logits of [Hkv, G * 256, tokens] in float32


def keys_and_values(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks in vLLM's CPU layout [N, Hkv, block_size, 2 * D] -> keys and values [Hkv, N * block_size, D]."""
    kv_heads, dim = blocks.shape[1], blocks.shape[3] // 2
    keys = key_view(blocks).permute(1, 0, 3, 2)  # [Hkv, N, block_size, D]
    values = value_view(blocks).permute(1, 0, 2, 3)
    return keys.reshape(kv_heads, -1, dim), values.reshape(kv_heads, -1, dim)


def attend_with_rest(query: torch.Tensor, kept: tuple[torch.Tensor, torch.Tensor], cold: tuple[torch.Tensor, torch.Tensor],
                     scale: float, score_queries: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """query [n, H, D] (a prompt chunk's, its tokens the last n of ``kept``), kept and cold (keys, values)
    [Hkv, S, D] -> (output [n, H, D] in the query's dtype, [S / block_size] float32: the attention each kept
    block received from the chunk's scoring queries, its last ``score_queries`` or all where 0)."""
    n, heads, dim = query.shape
    kv_heads, kept_len = kept[0].shape[0], kept[0].shape[1]
    group = heads // kv_heads
    keys = torch.cat([cold[0], kept[0]], dim=1).float()
    values = torch.cat([cold[1], kept[1]], dim=1).float()
    cold_len = cold[0].shape[1]
    q = grouped(query, kv_heads, torch.float32).view(kv_heads, group, n, dim)
    out = torch.empty(kv_heads, group, n, dim)
    received = torch.zeros(kept_len)
    first_scoring = n - score_queries if score_queries else 0
    for start in range(0, n, QUERY_BLOCK):
        stop = min(n, start + QUERY_BLOCK)
        rows = stop - start
        logits = torch.matmul(q[:, :, start:stop].reshape(kv_heads, group * rows, dim), keys.transpose(1, 2)) * scale
        # query start + i sits at kept place kept_len - n + start + i: it sees the chunk's tokens up to itself
        bias = causal_bias(n, group).view(group, n, n)[:, start:stop].reshape(group * rows, n)
        logits[:, :, logits.shape[-1] - n:] += bias
        probs = torch.softmax(logits, dim=-1)
        out[:, :, start:stop] = torch.matmul(probs, values).view(kv_heads, group, rows, dim)
        if stop > first_scoring:
            scoring = probs.view(kv_heads, group, rows, -1)[:, :, max(0, first_scoring - start):]
            received += scoring.sum(dim=(0, 1, 2))[cold_len:]
    output = out.permute(2, 0, 1, 3).reshape(n, heads, dim).to(query.dtype)
    padded = torch.zeros(-(-kept_len // block_size) * block_size)
    padded[:kept_len] = received
    return output, padded.view(-1, block_size).sum(dim=1)
