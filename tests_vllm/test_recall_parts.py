"""Recall's parts on a worker, against obvious references, without starting vLLM: the cold blocks kept in
vLLM's layout, the blocks each KV head recalls, the copies into the recall slots, and the options."""

from __future__ import annotations

import pytest
import torch

from h2ochat_vllm.cold_blocks import ColdBlocks, cold_keys
from h2ochat_vllm.settings import read_settings

KV_HEADS, HEADS, DIM, BLOCK = 2, 4, 16, 8


def random_cache(blocks: int, seed: int) -> torch.Tensor:
    """A layer of vLLM's CPU cache [blocks, Hkv, block_size, 2 * D] (keys channel-major, then values)."""
    return torch.randn(blocks, KV_HEADS, BLOCK, 2 * DIM, generator=torch.Generator().manual_seed(seed))


def keys_of(cache: torch.Tensor, block: int, head: int) -> torch.Tensor:
    """[block_size, D]: the keys of one block and KV head, read as vLLM's ``vec`` kernels store them."""
    return cache[block, head].reshape(-1)[: DIM * BLOCK].view(DIM, BLOCK).T


def best_blocks(queries, cache, cold_physical, head, count):
    """The obvious rule: the cold blocks with the largest q.k of any key, over the KV head's query heads."""
    group = HEADS // KV_HEADS
    q = queries[:, head * group: (head + 1) * group].reshape(-1, DIM)
    best = [float((q @ keys_of(cache, block, head).T).max()) for block in cold_physical]
    return sorted(range(len(cold_physical)), key=lambda i: -best[i])[:count]


def test_cold_keys_read_vllm_layout():
    cache = random_cache(5, seed=0)
    keys = cold_keys(cache[[3, 1]])
    for n, block in enumerate([3, 1]):
        for head in range(KV_HEADS):
            assert torch.equal(keys[head, n], keys_of(cache, block, head))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("queries_per_step", [1, 3])
def test_each_head_recalls_the_blocks_with_the_best_key(seed, queries_per_step):
    """Three requests at once with different cold blocks: one query each (a decode step: every request in one
    call of the C page scorer where it runs) or three (a chunk's: through the selector, request by request)."""
    cache = random_cache(40, seed)
    original = cache.clone()
    cold = ColdBlocks()
    evicted = {"a": [(1, 5), (2, 9), (4, 3), (6, 12), (7, 0)], "b": [(0, 20), (3, 21), (5, 22)],
               "c": [(2, 30), (3, 31), (4, 32), (5, 33), (6, 34), (8, 35), (9, 36)]}
    for req_id, pairs in evicted.items():
        cold.keep(req_id, "layer0", cache, tuple(pairs[:2]))
    for req_id, pairs in evicted.items():
        cold.keep(req_id, "layer0", cache, tuple(pairs[2:]))  # a later step's evictions are appended
    everything = [p for pairs in evicted.values() for _, p in pairs]
    cache[everything] = torch.randn(len(everything), KV_HEADS, BLOCK, 2 * DIM)  # the pool gives them to others
    slots = {"a": (14, 15), "b": (16, 17, 18), "c": (19, 24)}
    generator = torch.Generator().manual_seed(100 + seed)
    queries = {req_id: torch.randn(queries_per_step, HEADS, DIM, generator=generator) for req_id in evicted}
    cold.recall("layer0", cache, [(req_id, slots[req_id], queries[req_id]) for req_id in evicted])
    for req_id, pairs in evicted.items():
        physical = [p for _, p in pairs]
        for head in range(KV_HEADS):
            best = best_blocks(queries[req_id], original, physical, head, len(slots[req_id]))
            expected = {physical[i] for i in best}
            held = set()
            for slot in slots[req_id]:
                match = [p for p in physical if torch.equal(cache[slot, head], original[p, head])]
                assert len(match) == 1
                held.add(match[0])
            assert held == expected


def test_a_block_chosen_again_is_not_copied_again():
    cache = random_cache(12, seed=1)
    cold = ColdBlocks()
    cold.keep("r", "layer0", cache, ((0, 1), (1, 2), (2, 3), (3, 4)))
    queries = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(7))
    cold.recall("layer0", cache, [("r", (10, 11), queries)])
    assert cold.copies == 2 * KV_HEADS
    cold.recall("layer0", cache, [("r", (10, 11), queries)])
    assert cold.copies == 2 * KV_HEADS  # the same choice: nothing to copy
    cold.forget("r")
    assert cold.requests == {} and cold.key_rows["layer0"].rows == {}


def test_more_slots_than_cold_blocks_is_refused():
    cache = random_cache(8, seed=2)
    cold = ColdBlocks()
    cold.keep("r", "layer0", cache, ((0, 1),))
    with pytest.raises(RuntimeError, match="disagree"):
        cold.recall("layer0", cache, [("r", (6, 7), torch.randn(1, HEADS, DIM))])


def test_recall_options():
    settings = read_settings({"budget": 256, "recall": 0.5, "recall_memory": "64MiB"}, None)
    assert settings.recall_blocks(32) == 4 and settings.blocks(32).slots == 4
    assert settings.recall_memory == 64 << 20 and settings.selector == "auto"
    assert read_settings({"budget": 256}, None).recall_blocks(32) == 0
    with pytest.raises(ValueError, match="less than one block"):
        read_settings({"budget": 256, "recall": 0.1}, None).blocks(32)
    with pytest.raises(ValueError, match="besides recall"):
        read_settings({"budget": 128, "recall": 0.5}, None).blocks(32)
    with pytest.raises(ValueError, match="unknown selector"):
        read_settings({"budget": 256, "recall": 0.5, "selector": "best"}, None)
    with pytest.raises(ValueError, match="recall_memory"):
        read_settings({"budget": 256, "recall": 0.5, "recall_memory": "lots"}, None)
    with pytest.raises(ValueError, match="recall_queries"):
        read_settings({"budget": 256, "recall": 0.5, "recall_queries": 0}, None)


def test_another_selector_ranks_through_itself():
    """With Quest's per-channel bound (``selector quest``) a decode step's choice is Quest's, not the exact
    keys': each head's slots hold the blocks whose box bound is largest for its queries."""
    from h2ochat_vllm.cold_blocks import selector_for

    cache = random_cache(12, seed=4)
    original = cache.clone()
    cold = ColdBlocks()
    cold.use_selector(selector_for("quest"))
    pairs = ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5))
    cold.keep("r", "layer0", cache, pairs)
    assert cold.key_rows == {}  # the exact selector's keys are not kept for another
    queries = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(9))
    cold.recall("layer0", cache, [("r", (10, 11), queries)])
    group = HEADS // KV_HEADS
    physical = [p for _, p in pairs]
    for head in range(KV_HEADS):
        q = queries[:, head * group: (head + 1) * group].reshape(-1, DIM)
        bound = []
        for block in physical:
            keys = keys_of(original, block, head)
            low, high = keys.min(dim=0).values, keys.max(dim=0).values
            bound.append(float(torch.maximum(q * low, q * high).sum(dim=-1).max()))
        expected = {physical[i] for i in sorted(range(len(physical)), key=lambda i: -bound[i])[:2]}
        held = {next(p for p in physical if torch.equal(cache[slot, head], original[p, head])) for slot in (10, 11)}
        assert held == expected
