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

A slot's content is tracked per layer and KV head, so a block chosen again is not copied again. Nothing here
decides which blocks go cold or how many slots a request has: the scheduler's plan says so, the same on
every tensor-parallel rank; each rank keeps and chooses for its own KV heads (whose attention it computes
alone), so ranks may recall different blocks for different heads, as h2ochat's own recall does per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2ochat.recall.selectors import Selector, get_selector
from h2ochat.recall.selector_names import resolved_selector

from .scores import grouped


def selector_for(name: str) -> Selector:
    """h2ochat's selector ``name``; ``auto`` is exact here (the cold keys sit in host memory, scored in place)."""
    return get_selector(resolved_selector(name, keys_in_place=True))


def cold_keys(blocks: torch.Tensor) -> torch.Tensor:
    """Cold blocks in vLLM's layout [N, Hkv, block_size, 2 * D] -> their keys as the selectors take pages,
    [Hkv, N, block_size, D] (a copy: keys are stored channel-major)."""
    count, kv_heads, block_size, both = blocks.shape
    keys = blocks.view(count, kv_heads, 2, both // 2, block_size)[:, :, 0]  # [N, Hkv, D, bs]
    return keys.permute(1, 0, 3, 2).contiguous()


@dataclass
class LayerStore:
    """One request's cold blocks for one layer, with the recall slots' content."""

    blocks: torch.Tensor  # [capacity, Hkv, block_size, 2 * D], the first ``count`` written
    count: int = 0
    digest: object = None  # the selector's digest of the first ``count`` blocks (None: stale)
    slot_ids: tuple[int, ...] = ()  # the physical slots the content below belongs to
    content: torch.Tensor | None = None  # [slots, Hkv] long: the cold block each slot holds, -1 for none

    def append(self, taken: torch.Tensor) -> None:
        needed = self.count + taken.shape[0]
        if needed > self.blocks.shape[0]:
            grown = self.blocks.new_empty((max(needed, 2 * self.blocks.shape[0]), *self.blocks.shape[1:]))
            grown[: self.count] = self.blocks[: self.count]
            self.blocks = grown
        self.blocks[self.count: needed] = taken
        self.count = needed
        self.digest = None

    def nbytes(self) -> int:
        return self.blocks.nbytes


def chosen_blocks(selector: Selector, store: LayerStore, queries: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` cold blocks each KV head recalls: queries [n, H, D] (the step's choosing queries of
    one request) -> [Hkv, count] indices into the store, best first."""
    if store.digest is None:
        keys = cold_keys(store.blocks[: store.count])
        store.digest = selector.digest(keys, torch.ones(keys.shape[:3], dtype=torch.bool))
    kv_heads = store.blocks.shape[1]
    # queries in the cache's dtype: the C kernel scores bf16 keys with bf16 queries, as the attention does
    scores = selector.score(grouped(queries, kv_heads, store.blocks.dtype), store.digest)  # [Hkv, N]
    return scores.topk(count, dim=-1).indices


def fill_slots(kv_cache: torch.Tensor, store: LayerStore, slots: tuple[int, ...], chosen: torch.Tensor) -> int:
    """Put each KV head's chosen cold blocks [Hkv, len(slots)] into the slots (physical blocks of
    ``kv_cache``), copying only what a slot does not hold yet; returns the (block, head) copies made."""
    kv_heads = chosen.shape[0]
    if store.slot_ids != slots or store.content is None:
        store.slot_ids, store.content = slots, torch.full((len(slots), kv_heads), -1, dtype=torch.long)
    copies = 0
    for head in range(kv_heads):
        wanted = chosen[head].tolist()
        held = store.content[:, head].tolist()
        missing = [block for block in wanted if block not in held]
        for slot, block in enumerate(held):
            if block in wanted:
                continue
            new = missing.pop()
            kv_cache[slots[slot], head].copy_(store.blocks[new, head])
            store.content[slot, head] = new
            copies += 1
    return copies


class ColdBlocks:
    """Every request's cold blocks on this worker (its own KV heads), kept across steps until the request
    finishes or starts again."""

    def __init__(self):
        self.requests: dict[str, dict[str, LayerStore]] = {}  # req id -> layer name -> its cold blocks
        self.selector: Selector = selector_for("auto")
        self.copies = 0  # (block, head) copies into recall slots so far: what recall costs in memory traffic

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def keep(self, req_id: str, layer: str, kv_cache: torch.Tensor, to_cold: tuple[tuple[int, int], ...]) -> None:
        """Copy this step's newly evicted blocks ((logical, physical) pairs) of one layer out of the cache,
        before any slot is filled (a slot may be a block another request just gave up)."""
        layers = self.requests.setdefault(req_id, {})
        layer_store = layers.get(layer)
        if layer_store is None:
            layer_store = layers[layer] = LayerStore(kv_cache.new_empty((max(4, len(to_cold)), *kv_cache.shape[1:])))
        physical = torch.tensor([block for _, block in to_cold], dtype=torch.long)
        layer_store.append(kv_cache.index_select(0, physical))

    def recall(self, req_id: str, layer: str, kv_cache: torch.Tensor, slots: tuple[int, ...],
               queries: torch.Tensor) -> None:
        """Fill the request's recall slots of this layer with the cold blocks ``queries`` [n, H, D] choose."""
        layer_store = self.requests[req_id][layer]
        count = len(slots)
        if count > layer_store.count:
            raise RuntimeError(f"h2ochat: request {req_id} has {count} recall slots but {layer_store.count} cold "
                               "blocks on this worker: the scheduler's plan and the worker disagree")
        chosen = chosen_blocks(self.selector, layer_store, queries, count)
        self.copies += fill_slots(kv_cache, layer_store, slots, chosen)

    def blocks(self, req_id: str, layer: str) -> torch.Tensor | None:
        """The request's cold blocks of one layer [N, Hkv, block_size, 2 * D], None where it has none."""
        layer_store = self.requests.get(req_id, {}).get(layer)
        return layer_store.blocks[: layer_store.count] if layer_store is not None and layer_store.count else None

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layers in self.requests.values() for layer in layers.values())


COLD = ColdBlocks()
