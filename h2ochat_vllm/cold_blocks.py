"""Recall inside vLLM, a worker's side: the evicted blocks of each request kept in host memory, and the
recall slots filled from them, layer by layer, with the blocks the step's queries need most.

vLLM's CPU build holds its KV cache in host memory already, so a cold block is a copy of the evicted
block's bytes in vLLM's own layout (one layer: [KV heads, block_size, 2 * head_size], keys channel-major,
then values), taken before the block returns to vLLM's pool, beside a digest of its keys made by one of
h2ochat's page selectors (``h2ochat.recall.selectors``: a vLLM block is the page). Each step, before a
layer attends, every KV head scores the request's cold blocks with the queries that read it and the best
``len(slots)`` come back, per KV head, into the request's recall slots: physical blocks the scheduler gave
the request inside its budget. The kernel then attends them as any other block of the row. The keys were
stored rotated at their true positions, so relative distances hold wherever a slot sits in the row.

The exact selector (the default) keeps every request's cold keys of a layer in one tensor (``KeyRows``, a row
per request, as h2ochat's own cold store keeps its rows), so that one call of h2ochat's C page scorer
(``recall_ops.top_pages``) chooses for every request that decodes a token in the step; a prompt chunk's
queries, another selector, or a machine without the C kernel score request by request through the
selector itself (the same choice up to the order of fp32 sums).

A slot's content is tracked per layer and KV head, so a block chosen again is not copied again. Nothing here
decides which blocks go cold or how many slots a request has: the scheduler's plan says so, the same on
every tensor-parallel rank; each rank keeps and chooses for its own KV heads (whose attention it computes
alone), so ranks may recall different blocks for different heads, as h2ochat's own recall does per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2ochat.recall.selector_names import resolved_selector
from h2ochat.recall.selectors import Selector, get_selector
from h2ochat_kernels.cpu import recall_ops

from .scores import grouped, key_view


def selector_for(name: str) -> Selector:
    """h2ochat's selector ``name``; ``auto`` is exact here (the cold keys sit in host memory, scored in place)."""
    return get_selector(resolved_selector(name, keys_in_place=True))


def cold_keys(blocks: torch.Tensor) -> torch.Tensor:
    """Cold blocks in vLLM's layout [N, Hkv, block_size, 2 * D] -> their keys as the selectors take pages,
    [Hkv, N, block_size, D] (a copy: keys are stored channel-major)."""
    return key_view(blocks).permute(1, 0, 3, 2).contiguous()


def grown(tensor: torch.Tensor, dim: int, needed: int) -> torch.Tensor:
    """``tensor`` with at least ``needed`` places along ``dim`` (doubled when short; the old content kept)."""
    size = tensor.shape[dim]
    if needed <= size:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = max(needed, 2 * size)
    bigger = tensor.new_zeros(shape)
    bigger.narrow(dim, 0, size).copy_(tensor)
    return bigger


@dataclass
class LayerStore:
    """One request's cold blocks for one layer, with the recall slots' content."""

    blocks: torch.Tensor  # [capacity, Hkv, block_size, 2 * D], the first ``count`` written
    count: int = 0
    digest: object = None  # the selector's digest of the first ``count`` blocks (None: stale)
    slot_ids: tuple[int, ...] = ()  # the physical slots the content below belongs to
    content: list[list[int]] | None = None  # per slot and KV head, the cold block it holds (-1: none)

    def append(self, taken: torch.Tensor) -> None:
        self.blocks = grown(self.blocks, 0, self.count + taken.shape[0])
        self.blocks[self.count: self.count + taken.shape[0]] = taken
        self.count += taken.shape[0]
        self.digest = None

    def selector_choice(self, selector: Selector, queries: torch.Tensor, count: int) -> torch.Tensor:
        """[Hkv, count]: each KV head's best cold blocks for queries [n, H, D], through the selector itself."""
        if self.digest is None:
            keys = cold_keys(self.blocks[: self.count])
            self.digest = selector.digest(keys, torch.ones(keys.shape[:3], dtype=torch.bool))
        # queries in the cache's dtype: the C kernel scores bf16 keys with bf16 queries, as the attention does
        scores = selector.score(grouped(queries, self.blocks.shape[1], self.blocks.dtype), self.digest)  # [Hkv, N]
        return scores.topk(count, dim=-1).indices

    def fill(self, kv_cache: torch.Tensor, slots: tuple[int, ...], chosen: list[list[int]]) -> int:
        """Put each KV head's chosen cold blocks (``chosen[head]``, one per slot) into the slots (physical blocks
        of ``kv_cache``), copying only what a slot does not hold yet; returns the (block, head) copies made."""
        kv_heads = len(chosen)
        if self.slot_ids != slots or self.content is None:
            self.slot_ids, self.content = slots, [[-1] * kv_heads for _ in slots]
        copies = 0
        for head in range(kv_heads):
            wanted = set(chosen[head])
            held = [self.content[slot][head] for slot in range(len(slots))]
            missing = [block for block in chosen[head] if block not in held]
            for slot, block in enumerate(held):
                if block in wanted:
                    continue
                new = missing.pop()
                kv_cache[slots[slot], head].copy_(self.blocks[new, head])
                self.content[slot][head] = new
                copies += 1
        return copies


class KeyRows:
    """Every request's cold keys of one layer in one tensor [rows, Hkv, tokens, D], a row per request (the
    exact selector's digest, laid out as h2ochat's C page scorer reads it), so one call scores them all."""

    def __init__(self, kv_heads: int, block_size: int, dim: int, dtype: torch.dtype):
        self.block_size = block_size
        self.keys = torch.zeros(4, kv_heads, 4 * block_size, dim, dtype=dtype)
        self.tokens = torch.zeros(4, kv_heads, dtype=torch.long)  # the tokens each row holds (the same per head)
        self.rows: dict[str, int] = {}

    def row_of(self, req_id: str) -> int:
        if req_id not in self.rows:
            taken = set(self.rows.values())
            row = next(r for r in range(len(taken) + 1) if r not in taken)
            self.keys = grown(self.keys, 0, row + 1)
            self.tokens = grown(self.tokens, 0, row + 1)
            self.rows[req_id] = row
        return self.rows[req_id]

    def append(self, req_id: str, blocks: torch.Tensor) -> None:
        row = self.row_of(req_id)
        start = int(self.tokens[row, 0])
        end = start + blocks.shape[0] * self.block_size
        self.keys = grown(self.keys, 2, end)
        self.keys[row, :, start:end] = cold_keys(blocks).flatten(1, 2)
        self.tokens[row] = end

    def drop(self, req_id: str) -> None:
        row = self.rows.pop(req_id, None)
        if row is not None:
            self.tokens[row] = 0

    def choose(self, req_ids: list[str], queries: torch.Tensor, count: int) -> dict[str, list[list[int]]] | None:
        """For requests with one query each (queries [R, H, D], in the order of ``req_ids``), each KV head's
        ``count`` best cold blocks (best first; -1 past the request's own), in one call of the C page scorer;
        None where it does not run here (the caller scores through the selector)."""
        kv_heads = self.keys.shape[1]
        rows = torch.tensor([self.rows[req_id] for req_id in req_ids])
        step = grouped(queries.unsqueeze(1), kv_heads, self.keys.dtype)  # [R, Hkv, G, D]
        every = torch.zeros(self.keys.shape[0], *step.shape[1:], dtype=self.keys.dtype)
        every.index_copy_(0, rows, step)  # rows outside the step: no query, and no tokens to score below
        tokens = torch.zeros_like(self.tokens).index_copy_(0, rows, self.tokens.index_select(0, rows))
        best = recall_ops.top_pages(every, self.keys[:, :, : int(tokens.max())], tokens, self.block_size, count)
        if best is None:
            return None
        return dict(zip(req_ids, best.index_select(0, rows).tolist()))  # req id -> [Hkv][count]


class ColdBlocks:
    """Every request's cold blocks on this worker (its own KV heads), kept across steps until the request
    finishes or starts again."""

    def __init__(self):
        self.requests: dict[str, dict[str, LayerStore]] = {}  # req id -> layer name -> its cold blocks
        self.key_rows: dict[str, KeyRows] = {}  # layer name -> the exact selector's keys of every request
        self.selector: Selector = selector_for("auto")
        self.copies = 0  # (block, head) copies into recall slots so far: what recall costs in memory traffic

    def use_selector(self, selector: Selector) -> None:
        """Rank cold blocks with ``selector`` from now on (the plugin's ``selector`` option, set as the worker's
        connector starts, before any block goes cold)."""
        self.selector = selector
        for layers in self.requests.values():
            for layer_store in layers.values():
                layer_store.digest = None
        if not self.exact:
            self.key_rows.clear()

    @property
    def exact(self) -> bool:
        return self.selector.name == "exact"

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        for rows in self.key_rows.values():
            rows.drop(req_id)

    def keep(self, req_id: str, layer: str, kv_cache: torch.Tensor, to_cold: tuple[tuple[int, int], ...]) -> None:
        """Copy this step's newly evicted blocks ((logical, physical) pairs) of one layer out of the cache,
        before any slot is filled (a slot may be a block another request just gave up)."""
        layers = self.requests.setdefault(req_id, {})
        layer_store = layers.get(layer)
        if layer_store is None:
            layer_store = layers[layer] = LayerStore(kv_cache.new_empty((max(4, len(to_cold)), *kv_cache.shape[1:])))
        taken = kv_cache.index_select(0, torch.tensor([block for _, block in to_cold], dtype=torch.long))
        layer_store.append(taken)
        if self.exact:
            rows = self.key_rows.get(layer)
            if rows is None:
                rows = self.key_rows[layer] = KeyRows(kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3] // 2,
                                                      kv_cache.dtype)
            rows.append(req_id, taken)

    def recall(self, layer: str, kv_cache: torch.Tensor, wanted: list[tuple[str, tuple[int, ...], torch.Tensor]]) -> None:
        """Fill each request's recall slots of this layer with the cold blocks its queries choose: ``wanted``,
        (req id, slots, queries [n, H, D]) per request."""
        stores = {}
        for req_id, slots, _ in wanted:
            stores[req_id] = layer_store = self.requests[req_id][layer]
            if len(slots) > layer_store.count:
                raise RuntimeError(f"h2ochat: request {req_id} has {len(slots)} recall slots but {layer_store.count} "
                                   "cold blocks on this worker: the scheduler's plan and the worker disagree")
        chosen = {}
        single = [(req_id, queries) for req_id, _, queries in wanted if queries.shape[0] == 1]
        if self.exact and single and layer in self.key_rows:
            chosen = self.key_rows[layer].choose([req_id for req_id, _ in single],
                                                 torch.cat([queries for _, queries in single]),
                                                 max(len(slots) for _, slots, _ in wanted)) or {}
        for req_id, slots, queries in wanted:
            if req_id in chosen:
                picked = [head[: len(slots)] for head in chosen[req_id]]
            else:
                picked = stores[req_id].selector_choice(self.selector, queries, len(slots)).tolist()
            self.copies += stores[req_id].fill(kv_cache, slots, picked)

    def blocks(self, req_id: str, layer: str) -> torch.Tensor | None:
        """The request's cold blocks of one layer [N, Hkv, block_size, 2 * D], None where it has none."""
        layer_store = self.requests.get(req_id, {}).get(layer)
        return layer_store.blocks[: layer_store.count] if layer_store is not None and layer_store.count else None

    def nbytes(self) -> int:
        stores = sum(layer.blocks.nbytes for layers in self.requests.values() for layer in layers.values())
        return stores + sum(rows.keys.nbytes for rows in self.key_rows.values())


COLD = ColdBlocks()
