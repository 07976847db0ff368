"""One batch row's cache state moved between caches (``H2OCache.export_row`` / ``import_row`` /
``reset_row`` / ``allocate``): the contract a server relies on to prefill a request alone and then
decode it inside a batch of others.

The reference for the moved row is the 1-row cache it came from, continuing alone; the reference
for the other rows is the same batch run without the import. Every run feeds the same tokens to
both sides (drawn at random, not sampled from the logits), so a near-tie between two logits cannot
make the two runs diverge: the logits themselves are compared, within fp32 rounding. A batch of 3
and a batch of 1 round differently, so the moved row's evictions are compared as in
tests/lockstep.py (a differing one must be a tie, and the comparison stops there).
"""

from __future__ import annotations

import pytest
import torch

from h2ochat.kv import CacheShapeError, H2OCache
from h2ochat.engine.generation import CacheSettings, forward, prefill

from conftest import build_model, random_ids
from lockstep import EvictionRecorder, kept_agree_or_tie

BATCH, ROW, SLOTS = 3, 1, 10
# value_eps: a policy that keeps value norms (one more state tensor); layer_shape: per-layer capacities
POLICIES = ["h2o", "mean:value_eps=0.05:layer_shape=0.5"]


def _batch_mid_generation(model, settings, ids, mask, fed):
    cache = settings.build(model, static_shapes=True)
    prefill(model, cache, ids, mask)
    for column in range(fed.shape[1]):
        forward(model, cache, fed[:, column:column + 1], logits_to_keep=1)
    return cache


def _held(cache: H2OCache, row: int):
    """Per layer, the (token, position, score) triples each KV head of ``row`` holds, in token order."""
    held = []
    for layer in cache.layers:
        for head in range(layer.token_index.shape[1]):
            tokens = layer.token_index[row, head]
            order = tokens.argsort()
            order = order[tokens[order] >= 0]
            held.append((tokens[order], layer.positions[row, head][order], layer.scores[row, head][order]))
    return held


def _assert_same_held(a, b, where):
    assert len(a) == len(b)
    for index, ((tokens_a, pos_a, scores_a), (tokens_b, pos_b, scores_b)) in enumerate(zip(a, b)):
        assert torch.equal(tokens_a, tokens_b), f"{where}: layer/head {index} holds other tokens"
        assert torch.equal(pos_a, pos_b), f"{where}: layer/head {index} holds other positions"
        torch.testing.assert_close(scores_a, scores_b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_imported_row_continues_as_its_own_cache_and_leaves_the_others_alone(family, policy, seed):
    model = build_model(family)
    settings = CacheSettings(policy=policy, budget=str(SLOTS))
    ids, mask = random_ids(BATCH, 12), torch.ones(BATCH, 12, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, :2] = 0
    fed = random_ids(BATCH, 3)
    base = _batch_mid_generation(model, settings, ids, mask, fed)
    target = _batch_mid_generation(model, settings, ids, mask, fed)
    # the row to move: a longer prompt than the others have seen, prefilled alone (past its budget)
    single = settings.build(model)
    prefill(model, single, random_ids(1, 20))
    state = single.export_row(0)
    assert state.tokens_fed == 20 and state.nbytes > 0
    assert all(t.device.type == "cpu" for part in [*state.layers, state.counters] for t in part.values())
    target.import_row(ROW, state)
    assert target.largest_next_position == int(target.next_position.max()) == 20
    _assert_same_held(_held(target, ROW), _held(single, 0), "after the import")

    steps = random_ids(BATCH, 8)
    others = [row for row in range(BATCH) if row != ROW]
    recorder = EvictionRecorder(single)
    diverged = False  # the row alone and in the batch round differently: an eviction tie may split them
    with recorder.recording():
        for step in range(steps.shape[1]):
            tokens = steps[:, step:step + 1]
            got = forward(model, target, tokens, logits_to_keep=1)[:, -1]
            alone = forward(model, single, tokens[ROW:ROW + 1], logits_to_keep=1)[:, -1]
            untouched = forward(model, base, tokens, logits_to_keep=1)[:, -1]
            if not diverged:
                torch.testing.assert_close(got[ROW:ROW + 1], alone, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"step {step}: {m}")
                diverged = not kept_agree_or_tie(single, target, recorder, f"step {step}", rows=[(0, ROW)])
            # the other rows run the very same computation as without the import: equal bit for bit
            assert torch.equal(got[others], untouched[others]), f"step {step}, other rows"
    assert single.evicted_tokens() > 0  # the moved row kept evicting in the batch as it would alone
    if not diverged:
        _assert_same_held(_held(target, ROW), _held(single, 0), "after decoding")
    for row in others:
        _assert_same_held(_held(target, row), _held(base, row), f"row {row}")


def test_allocate_then_import_into_a_one_row_cache_and_reset_a_row(seed):
    model = build_model("llama")
    settings = CacheSettings(policy="h2o", budget=str(SLOTS))
    ids = random_ids(BATCH, 14)
    batch = settings.build(model, static_shapes=True)
    prefill(model, batch, ids)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    alone = settings.build(model)
    alone.allocate(1, config.num_key_value_heads, head_dim, dtype=torch.float32, device="cpu")
    assert alone.initialized and alone.longest_row_tokens() == 0
    alone.import_row(0, batch.export_row(ROW))
    assert alone.longest_row_tokens() == 14 and alone.largest_next_position == 14
    for step in range(4):
        token = random_ids(BATCH, 1)
        got = forward(model, batch, token, logits_to_keep=1)[:, -1]
        want = forward(model, alone, token[ROW:ROW + 1], logits_to_keep=1)[:, -1]
        torch.testing.assert_close(got[ROW:ROW + 1], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step}: {m}")

    before = {row: batch.export_row(row) for row in range(BATCH)}
    batch.reset_row(ROW)
    empty = settings.build(model)
    empty.allocate(1, config.num_key_value_heads, head_dim, dtype=torch.float32, device="cpu")
    for row in range(BATCH):
        want = empty.export_row(0) if row == ROW else before[row]
        got = batch.export_row(row)
        for got_part, want_part in zip([*got.layers, got.counters], [*want.layers, want.counters]):
            for name, tensor in want_part.items():
                assert torch.equal(got_part[name], tensor), f"row {row} {name}"
    assert batch.largest_next_position == max(before[row].counters["next_position"] for row in range(BATCH) if row != ROW)


def test_a_row_state_that_does_not_fit_is_refused(seed):
    model = build_model("llama")
    small = CacheSettings(policy="h2o", budget="6").build(model)
    prefill(model, small, random_ids(1, 8))
    other = CacheSettings(policy="h2o", budget="8").build(model)
    prefill(model, other, random_ids(1, 8))
    with pytest.raises(CacheShapeError, match="does not fit"):
        other.import_row(0, small.export_row(0))
    with pytest.raises(CacheShapeError, match="allocate"):
        CacheSettings(policy="h2o", budget="6").build(model).import_row(0, small.export_row(0))


@pytest.mark.parametrize("recall", [None, "8"])
def test_a_row_exported_in_place_is_views_of_the_cache_that_equal_its_copy(seed, recall):
    """``export_row(copy=False)`` (a server installing its 1-row prefill cache, which it drops after): every
    tensor is a view of the cache's own memory, with the values ``export_row`` copies; with a recall tier,
    its stores cut to the row's tokens as in the copy."""
    model = build_model("llama")
    settings = CacheSettings(policy="h2o", budget="16", recall=recall, page=4 if recall else None)
    cache = settings.build(model)
    prefill(model, cache, random_ids(1, 40))
    copied, viewed = cache.export_row(0), cache.export_row(0, copy=False)
    owned = {tensor.untyped_storage().data_ptr() for layer in cache.layers for tensor in layer.state_tensors().values()}
    owned |= {tensor.untyped_storage().data_ptr() for tensor in cache._row_counters().values()}
    for got_part, want_part in zip([*viewed.layers, viewed.counters], [*copied.layers, copied.counters]):
        assert set(got_part) == set(want_part)
        for name, tensor in want_part.items():
            assert torch.equal(got_part[name], tensor), name
            assert got_part[name].untyped_storage().data_ptr() in owned, name
    if recall:
        assert any(name.startswith("cold_") for name in copied.layers[0])
