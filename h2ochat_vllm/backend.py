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
from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from h2ochat_kernels.cpu import block_scores_ops

from .cold_blocks import COLD
from .rest import attend_with_rest, keys_and_values
from .scores import block_scores, decode_block_scores, key_view
from .worker_state import STATE, ScoredRow

KEY_LAYOUT_ISAS = ("vec", "vec16")  # vLLM's CPU kernels whose key cache ``scores.key_view`` reads (channel-major)


def compact(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, plans: dict):
    """(block table, seq lens, rows) with each planned request's evicted blocks left out and its recall
    slots put first (they hold blocks older than any the step writes, so a prompt chunk's causal mask,
    which counts from the row's end, leaves them visible to every query)."""
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
        slots = list(plan.recall_slots)
        if len(kept) <= last or slots:
            if table is block_table:
                table = block_table.clone()  # the runner's persistent table stays as it is
            table[row, : len(slots)] = torch.tensor(slots, dtype=table.dtype)
            table[row, len(slots): len(slots) + len(kept)] = block_table[row, kept]
            new_lens[row] = length - (last + 1 - len(kept) - len(slots)) * block_size
        rows.append(ScoredRow(req_id, torch.tensor([-1] * len(slots) + kept, dtype=torch.long), last + 1))
    return table, torch.tensor(new_lens, dtype=seq_lens.dtype, device=seq_lens.device), rows


@dataclass(frozen=True)
class RecallWork:
    """What one layer does for one request of the step: before attending, keep its newly evicted blocks and
    fill its recall slots; for a prompt chunk with the rest on, its last queries then attend every cold block."""

    row: int
    req_id: str
    to_cold: tuple[tuple[int, int], ...]
    slots: tuple[int, ...]
    choosing: slice  # the step's last queries of the request: they choose its recalled blocks
    rest: bool  # a prompt chunk whose choosing queries attend every cold block (``rest``)


def recall_work(plans: dict, rows: list, starts: list[int], options) -> list[RecallWork]:
    work = []
    for r, row in enumerate(rows):
        plan = plans[row.req_id] if row is not None else None
        if plan is not None and (plan.to_cold or plan.recall_slots or row.req_id in COLD.requests):
            first = max(starts[r], starts[r + 1] - options.recall_queries)
            rest = options.recall_rest and starts[r + 1] - starts[r] > 1
            work.append(RecallWork(r, row.req_id, plan.to_cold, plan.recall_slots, slice(first, starts[r + 1]), rest))
    return work


class H2OCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        plans = STATE.plans
        if not plans:
            metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
            metadata.h2o_rows = None
            metadata.h2o_recall = []
            return metadata
        num_reqs = common_attn_metadata.num_reqs
        true_lens = common_attn_metadata.seq_lens[:num_reqs].tolist()  # (before compaction: a token's position + 1)
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
        # the rows that compute one token are scored together, as one batch per layer, at the steps they score
        starts = common_attn_metadata.query_start_loc_cpu[: num_reqs + 1]
        metadata.h2o_recall = recall_work(plans, rows, starts.tolist(), STATE.options)
        single = [r for r, row in enumerate(rows) if row is not None and int(starts[r + 1] - starts[r]) == 1]
        decoding = [r for r in single if STATE.scores_token_at(true_lens[r] - 1)]
        metadata.h2o_single = set(single)
        metadata.h2o_decoding = torch.tensor(decoding, dtype=torch.long)
        if decoding:
            width = max(rows[r].logical.numel() for r in decoding)
            metadata.h2o_decode_blocks = full_table[decoding, :width].long()
            metadata.h2o_decode_queries = starts[decoding].long()
            metadata.h2o_decode_lens = lens[decoding].long()
        return metadata


class H2OCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        work = getattr(attn_metadata, "h2o_recall", None) if attn_metadata is not None else None
        if work:
            self._recall(layer.layer_name, query, kv_cache, work)
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        rows = getattr(attn_metadata, "h2o_rows", None) if attn_metadata is not None else None
        if rows:
            self._check_layout(layer)
            rested = self._rest(layer.layer_name, query, kv_cache, attn_metadata, output, work) if work else {}
            self._score(query, kv_cache, attn_metadata, rows, rested)
        return result

    def _recall(self, layer_name: str, query, kv_cache, work: list[RecallWork]) -> None:
        # every request's newly evicted blocks leave the cache before any slot is written: a slot may be a block
        # that another request gave up this step
        for item in work:
            if item.to_cold:
                COLD.keep(item.req_id, layer_name, kv_cache, item.to_cold)
        query = query.view(query.shape[0], self.num_heads, self.head_size)
        wanted = [(item.req_id, item.slots, query[item.choosing]) for item in work if item.slots]
        if wanted:
            COLD.recall(layer_name, kv_cache, wanted)

    def _rest(self, layer_name: str, query, kv_cache, metadata, output, work: list[RecallWork]) -> dict[int, int]:
        """A prompt chunk's last queries attend its kept blocks and every cold block: their output rows are
        replaced and their block scores added here (``rest``); returns, per row done, how many queries."""
        done = {}
        query = query.view(query.shape[0], self.num_heads, self.head_size)
        output = output.view(output.shape[0], self.num_heads, self.head_size)
        block_size = kv_cache.shape[2]
        window = STATE.options.score_queries
        for item in work:
            cold = COLD.blocks(item.req_id, layer_name)
            if not item.rest or cold is None:
                continue
            slots = len(item.slots)
            kept_len = int(metadata.seq_lens[item.row]) - slots * block_size
            blocks = metadata.block_table[item.row, slots: slots + -(-kept_len // block_size)].long()
            kept_keys, kept_values = keys_and_values(kv_cache.index_select(0, blocks))
            count = item.choosing.stop - item.choosing.start
            out, received = attend_with_rest(query[item.choosing], (kept_keys[:, :kept_len], kept_values[:, :kept_len]),
                                             keys_and_values(cold), self.scale, min(window, count), block_size)
            output[item.choosing] = out.to(output.dtype)
            metadata.h2o_scores[item.row, slots: slots + received.numel()] += received
            done[item.row] = count
        return done

    def _check_layout(self, layer) -> None:
        isa = getattr(layer, "isa", "vec")
        if isa not in KEY_LAYOUT_ISAS:
            raise NotImplementedError(f"h2ochat: vLLM's {isa!r} CPU attention lays its keys out in a way the plugin "
                                      f"does not read yet (it reads {', '.join(KEY_LAYOUT_ISAS)})")

    def _score(self, query, kv_cache, metadata, rows, rested: dict[int, int]) -> None:
        key_cache = key_view(kv_cache)
        query = query.view(query.shape[0], self.num_heads, self.head_size)
        total = metadata.h2o_scores
        decoding = metadata.h2o_decoding
        if decoding.numel():
            # the C kernel reads the kept blocks in place; the torch route (its reference) gathers them first
            args = (query[metadata.h2o_decode_queries], key_cache, metadata.h2o_decode_blocks,
                    metadata.h2o_decode_lens, self.scale)
            got = block_scores_ops.decode_block_scores(*args)
            if got is None:
                got = decode_block_scores(*args)
            total[decoding, : got.shape[1]] += got
        starts = metadata.query_start_loc.tolist()
        lengths = metadata.seq_lens.tolist()
        for row, scored in enumerate(rows):
            if scored is None or row in metadata.h2o_single:
                continue
            # a chunk's queries the rest pass scored (its last ones) are left out: the others see none of their
            # tokens (causal), so they score as the last queries of a row that many tokens shorter
            rest = rested.get(row, 0)
            end, seq_len = starts[row + 1] - rest, lengths[row] - rest
            window = STATE.options.score_queries
            first = starts[row] if not window else max(starts[row], starts[row + 1] - window)
            if first >= end:
                continue
            kept = scored.logical.numel()
            blocks = metadata.block_table[row, :kept].long()
            got = block_scores_ops.block_scores(query[first:end].unsqueeze(0), key_cache, blocks.view(1, -1),
                                                torch.tensor([seq_len], dtype=torch.long), self.scale)
            if got is None:
                got = block_scores(query[first:end], key_cache, blocks, seq_len, self.scale)[None]
            total[row, : got.shape[1]] += got[0]


class H2OCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return H2OCPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return H2OCPUAttentionMetadataBuilder
