"""vLLM's CPU attention backend, with evicted blocks left out and block scores accumulated.

vLLM keeps a request's block table indexed by true position, so new tokens are written and rotated
at their true positions whatever was evicted. Before attention, each request's row is compacted: the
evicted blocks leave the row and the sequence length drops by their tokens, so vLLM's own kernel
attends only the kept blocks (keys stay rotated at their true positions: relative distances hold).
After it, the step's queries are scored against the kept blocks (``scores.block_scores``).

With no plan from the connector (the plugin installed, the connector not configured) every row
is left as it is and nothing is scored: the backend is vLLM's own.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from .scores import block_scores, decode_block_scores
from .worker_state import STATE, ScoredRow


def compact(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, plans: dict):
    """(block table, seq lens, rows) with each planned request's evicted blocks left out."""
    by_marker = {plan.marker_block: (req_id, plan) for req_id, plan in plans.items()}
    lengths = seq_lens.tolist()
    table, new_lens, rows = block_table, list(lengths), []
    for row, length in enumerate(lengths):
        last = (length - 1) // block_size
        found = by_marker.get(int(block_table[row, last])) if length > 0 else None
        if found is None:
            rows.append(None)
            continue
        req_id, plan = found
        evicted = set(plan.evicted)
        kept = [j for j in range(last + 1) if j not in evicted]
        if len(kept) <= last:
            if table is block_table:
                table = block_table.clone()  # the runner's persistent table stays as it is
            table[row, : len(kept)] = block_table[row, kept]
            new_lens[row] = length - (last + 1 - len(kept)) * block_size
        rows.append(ScoredRow(req_id, torch.tensor(kept, dtype=torch.long), last + 1))
    return table, torch.tensor(new_lens, dtype=seq_lens.dtype, device=seq_lens.device), rows


class H2OCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        plans = STATE.plans
        if not plans:
            metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
            metadata.h2o_rows = None
            return metadata
        num_reqs = common_attn_metadata.num_reqs
        table, lens, rows = compact(common_attn_metadata.block_table_tensor[:num_reqs],
                                    common_attn_metadata.seq_lens[:num_reqs], self.block_size, plans)
        full_table = common_attn_metadata.block_table_tensor.clone()
        full_table[:num_reqs] = table
        full_lens = common_attn_metadata.seq_lens.clone()
        full_lens[:num_reqs] = lens
        common_attn_metadata = dataclasses.replace(
            common_attn_metadata, block_table_tensor=full_table, seq_lens=full_lens,
            max_seq_len=int(lens.max()) if num_reqs else 0)
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.h2o_rows = rows
        metadata.h2o_scores = STATE.begin_step(rows)
        # the rows that decode one token are scored together, as one batch per layer
        starts = common_attn_metadata.query_start_loc_cpu[: num_reqs + 1]
        decoding = [r for r, row in enumerate(rows) if row is not None and int(starts[r + 1] - starts[r]) == 1]
        metadata.h2o_decoding = torch.tensor(decoding, dtype=torch.long)
        if decoding:
            width = max(rows[r].logical.numel() for r in decoding)
            metadata.h2o_decode_blocks = full_table[decoding, :width].long()
            metadata.h2o_decode_queries = starts[decoding].long()
        return metadata


class H2OCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        rows = getattr(attn_metadata, "h2o_rows", None) if attn_metadata is not None else None
        if rows:
            self._score(query, kv_cache, attn_metadata, rows)
        return result

    def _score(self, query, kv_cache, metadata, rows) -> None:
        num_blocks, kv_heads, block_size, _ = kv_cache.shape
        key_cache = kv_cache.view(num_blocks, kv_heads, block_size * 2, -1)[:, :, :block_size]
        query = query.view(query.shape[0], self.num_heads, self.head_size)
        total = metadata.h2o_scores
        decoding = metadata.h2o_decoding
        if decoding.numel():
            got = decode_block_scores(query[metadata.h2o_decode_queries], key_cache, metadata.h2o_decode_blocks,
                                      metadata.seq_lens[decoding], self.scale)
            total[decoding, : got.shape[1]] += got
        starts = metadata.query_start_loc.tolist()
        lengths = metadata.seq_lens.tolist()
        single = set(decoding.tolist())
        for row, scored in enumerate(rows):
            if scored is None or row in single:
                continue
            kept = scored.logical.numel()
            blocks = metadata.block_table[row, :kept].long()
            first = starts[row] if not STATE.score_queries else max(starts[row], starts[row + 1] - STATE.score_queries)
            total[row, :kept] += block_scores(query[first: starts[row + 1]], key_cache, blocks, lengths[row], self.scale)


class H2OCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return H2OCPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return H2OCPUAttentionMetadataBuilder
