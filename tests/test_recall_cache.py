"""The two-tier cache (an H2OCache with a recall tier) against the masked reference (MaskedRecall), all families."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build_model

from h2ochat.engine.attention import use_h2o_attention
from h2ochat.engine.forward_step import forward
from h2ochat.engine.generation import max_positions
from h2ochat.recall.masked import MaskedRecall
from conftest import EXACT, recall_cache
from h2ochat.recall.tiered import RecallConfig
from h2ochat.rotary import find_rotary

HOT, RECALL, PAGE = 12, 8, 4


def _caches(model, policy, selector, every=1, prefetch=False):
    """The real cache and its reference; ``prefetch``: a static-shape cache by the "before" rule (a GPU's
    compiled step), which chooses a decode step's pages before it with the last step's queries."""
    layers = model.config.num_hidden_layers
    rule = "before" if prefetch else "in-step"
    real = recall_cache(layers, policy, HOT, recall=RecallConfig(RECALL, PAGE, selector, cold_dtype=EXACT, every=every,
                                                                 decode_rule=rule),
                        max_positions=max_positions(model.config), positions="absolute", rotary=find_rotary(model),
                        static_shapes=prefetch)
    masked = MaskedRecall(layers, policy, HOT, RECALL, PAGE, selector, grouping="eviction", staged=True, every=every,
                          prefetch=prefetch)
    return real, masked


@pytest.mark.parametrize("every,prefetch", [(1, True), (3, False), (3, True), (16, False)])
def test_a_decode_cadence_is_the_masked_references(family, seed, every, prefetch):
    """--recall-every k (counted from the last flush; 16 > P: once a page), each step with its own
    queries or (prefetch) with the last step's: the same logits and the same hot, staged, recalled and
    cold tokens as the reference choosing on that schedule, through two turns (a chunk in between
    restarts the staging page)."""
    model = build_model(family, seed=seed, max_position_embeddings=256)
    real, masked = _caches(model, "h2o", "rot4", every, prefetch)
    ids = torch.randint(3, VOCAB, (1, 80))
    pieces = [ids[:, :20], *[ids[:, i : i + 1] for i in range(20, 47)], ids[:, 47:60],
              *[ids[:, i : i + 1] for i in range(60, 80)]]
    _feed_beside_the_reference(model, real, masked, pieces)


@pytest.mark.parametrize("policy,selector", [("h2o", "exact"), ("h2o", "rot4"), ("h2o", "quest"), ("mean", "exact")])
def test_recall_cache_is_the_masked_reference(family, seed, policy, selector):
    """Chunked prefill then decode: the same logits at every step as a full cache whose mask admits
    the policy's hot tokens plus the selector's top pages of evicted tokens."""
    model = build_model(family, seed=seed, max_position_embeddings=256)
    real, masked = _caches(model, policy, selector)
    ids = torch.randint(3, VOCAB, (1, 70))
    pieces = [ids[:, :20], ids[:, 20:45], *[ids[:, i : i + 1] for i in range(45, 70)]]
    _feed_beside_the_reference(model, real, masked, pieces)
    for layer in real.layers:
        assert int(layer.tier.frames.copied.sum()) > 0  # pages were recalled


def _tokens(index: torch.Tensor) -> set[int]:
    return set(index[index >= 0].tolist())


def _assert_the_reference_tokens(real, masked) -> None:
    """Per layer and KV head the same hot, staged and recalled tokens as the reference, and a cold
    store holding the reference's flushed tokens in its eviction order (what a per-token append
    would hold after the same flushes)."""
    for layer, state in zip(real.layers, masked.layers):
        first, end = layer.tier.cold.held()
        pages = torch.arange(max(int(end.max()), 1)).expand(*layer.keys.shape[:2], -1)
        _, _, cold_index, _ = layer.tier.cold.pages(pages)
        staged_mask = masked._staged(state)
        for head in range(layer.keys.shape[1]):
            assert _tokens(layer.token_index[0, head, : layer.capacity]) == _tokens(torch.nonzero(state.hot[head]).flatten())
            assert _tokens(layer.tier.staging.slots.token_index[0, head]) == set(torch.nonzero(staged_mask[head]).flatten().tolist())
            assert _tokens(layer.tier.slots.token_index[0, head]) == set(torch.nonzero(state.recalled[head]).flatten().tolist())
            flushed = state.cold[head] & ~staged_mask[head]
            order = sorted(torch.nonzero(flushed).flatten().tolist(), key=lambda t: int(state.evicted_at[head, t]))
            cold = cold_index[0, head]
            assert cold[cold >= 0].tolist() == order


def test_stores_that_grow_in_their_mappings_room_are_the_masked_reference(family, seed, monkeypatch):
    """Every host buffer a mapping of its own (as a long chat's are): the cold store and the digest's codes
    grow inside the address space their mapping reserved (``host_buffers.lengthened``), as longer views of
    the same memory, and the cache still gives the masked reference's logits and tokens."""
    from h2ochat import host_buffers

    monkeypatch.setattr(host_buffers, "MAPPED_BYTES", 1)
    model = build_model(family, seed=seed, max_position_embeddings=512)
    real, masked = _caches(model, "h2o", "rot4")
    ids = torch.randint(3, VOCAB, (1, 200))
    pieces = [ids[:, :20], *[ids[:, i : i + 1] for i in range(20, 200)]]
    addresses = set()
    for piece in pieces:
        _feed_beside_the_reference(model, real, masked, [piece])
        cold = real.layers[0].tier.cold
        addresses.add(cold.keys.data_ptr())
    assert cold.capacity >= 180 and not cold.keys.is_contiguous()  # (a view of a longer mapping)
    assert len(addresses) <= 4  # (grown ~20 times by pages: all but the first few in place)


def _feed_beside_the_reference(model, real, masked, pieces) -> None:
    """Each piece through the recall cache and the masked reference: the same logits and tokens after each."""
    for piece in pieces:
        MaskedRecall.attach(model)
        want = masked.forward(model, piece)
        use_h2o_attention(model)
        got = forward(model, real, piece, logits_to_keep=1)[:, -1]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        _assert_the_reference_tokens(real, masked)


def test_cold_store_holds_exactly_the_evicted_tokens(family, seed):
    """Every token fed is either in a hot slot or in the cold store of each (layer, head), once."""
    model = build_model(family, seed=seed, max_position_embeddings=256)
    real, _ = _caches(model, "h2o", "exact")
    ids = torch.randint(3, VOCAB, (1, 50))
    use_h2o_attention(model)
    for piece in [ids[:, :30], *[ids[:, i : i + 1] for i in range(30, 50)]]:
        forward(model, real, piece)
    for layer in real.layers:
        _assert_each_token_once(layer, 0, 50)


def test_recall_settings_are_checked():
    with pytest.raises(ValueError, match="whole number"):
        RecallConfig(10, 4)
    for wrong in ("quest2", "int9", "rot0", "int", "exact4"):
        with pytest.raises(ValueError, match="--selector .* choose auto .* exact .* quest .* intN .* rotN"):
            RecallConfig(8, 4, wrong)
    assert (RecallConfig(8, 4, "rot4").bits, RecallConfig(8, 4, "rot4").rotate) == (4, True)
    assert (RecallConfig(8, 4, "int2").bits, RecallConfig(8, 4, "int2").rotate) == (2, False)
    assert RecallConfig(8, 4, "quest").bits is None


def _assert_each_token_once(layer, row: int, tokens: int) -> None:
    """Every token 0..tokens-1 of ``row`` is in a hot slot, on the staging page or in the cold store
    of each KV head, once (cold + staged + hot == fed); the recall frames hold cold tokens only."""
    first, end = layer.tier.cold.held()
    pages = torch.arange(max(int(end.max()), 1)).expand(*layer.keys.shape[:2], -1)
    _, _, cold_index, _ = layer.tier.cold.pages(pages)
    for head in range(layer.keys.shape[1]):
        hot = layer.token_index[row, head, : layer.capacity]
        staged = layer.tier.staging.slots.token_index[row, head]
        cold = cold_index[row, head]
        held = [*hot[hot >= 0].tolist(), *staged[staged >= 0].tolist(), *cold[cold >= 0].tolist()]
        assert sorted(held) == list(range(tokens))
        recalled = layer.tier.slots.token_index[row, head]
        assert set(recalled[recalled >= 0].tolist()) <= set(cold[cold >= 0].tolist())


def test_a_left_padded_batch_recalls_as_the_masked_reference(family, seed):
    """Two rows of different prompt lengths, left-padded into one batch, prefilled in two chunks (the
    first with padding) then decoded: each row's logits are the masked reference's for that row
    alone, and its cold store holds exactly its own evicted tokens (padding never goes cold)."""
    model = build_model(family, seed=seed, max_position_embeddings=256)
    prompts = [torch.randint(3, VOCAB, (30,)), torch.randint(3, VOCAB, (22,))]
    follow = torch.randint(3, VOCAB, (2, 12))
    batch_cache, _ = _caches(model, "h2o", "exact")
    ids = torch.zeros(2, 30, dtype=torch.long)
    mask = torch.zeros(2, 30, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, 30 - len(prompt):], mask[row, 30 - len(prompt):] = prompt, 1
    use_h2o_attention(model)
    got = [forward(model, batch_cache, ids[:, :18], mask[:, :18])[:, -1], forward(model, batch_cache, ids[:, 18:])[:, -1]]
    got += [forward(model, batch_cache, follow[:, i : i + 1])[:, -1] for i in range(12)]
    assert all(bool((layer.tier.frames.copied > 0).all()) for layer in batch_cache.layers)  # both rows recalled
    for row, prompt in enumerate(prompts):
        _, masked = _caches(model, "h2o", "exact")
        MaskedRecall.attach(model)
        split = len(prompt) - 12
        want = [masked.forward(model, prompt[:split].view(1, -1)), masked.forward(model, prompt[split:].view(1, -1))]
        want += [masked.forward(model, follow[row : row + 1, i : i + 1]) for i in range(12)]
        for step, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g[row : row + 1], w, atol=2e-4, rtol=2e-4, msg=lambda m: f"row {row} step {step}: {m}")
        for layer in batch_cache.layers:
            _assert_each_token_once(layer, row, len(prompt) + 12)


def test_recalling_every_page_is_the_full_cache(family, seed):
    """Recall slots for every evicted token (and the exact selector): each step attends every token
    fed, so the logits are the full cache's, through chunks and decode steps."""
    from h2ochat.kv import H2OCache

    model = build_model(family, seed=seed, max_position_embeddings=256)
    layers, rotary = model.config.num_hidden_layers, find_rotary(model)
    real = recall_cache(layers, "h2o", 8, recall=RecallConfig(48, PAGE, "exact", cold_dtype=EXACT), max_positions=256, rotary=rotary)
    full = H2OCache(layers, "full", 8, max_positions=256, rotary=rotary)
    ids = torch.randint(3, VOCAB, (2, 50))
    use_h2o_attention(model)
    for piece in [ids[:, :14], ids[:, 14:30], *[ids[:, i : i + 1] for i in range(30, 50)]]:
        torch.testing.assert_close(forward(model, real, piece, logits_to_keep=1), forward(model, full, piece, logits_to_keep=1),
                                   atol=2e-4, rtol=2e-4)
    # (the frames hold what was cold before the last step, the staging page its victim too: 50 fed, 8 hot)
    assert all(int((layer.tier.recalled_token_index() >= 0).sum(-1).min()) == 50 - 8 for layer in real.layers)
