"""The recall tier's statistics (attention mass on recalled tokens, what the cold tier holds) against
a hand computation: the softmax written out over the slots each step attended."""

from __future__ import annotations

import pytest
import torch

from conftest import EXACT, recall_cache
from h2ochat.recall.tiered import RecallConfig

HOT, RECALL, PAGE = 8, 4, 2
BATCH, KV_HEADS, GROUP, DIM = 2, 2, 2, 8
SCALE = 0.35


def _cache(policy="h2o", cold_limit=None):
    return recall_cache(1, policy, HOT, recall=RecallConfig(RECALL, PAGE, "exact", cold_dtype=EXACT, cold_limit=cold_limit),
                       max_positions=10_000, positions="absolute")


def _step(cache, q_len, generator):
    key = torch.randn(BATCH, KV_HEADS, q_len, DIM, generator=generator)
    value = torch.randn(BATCH, KV_HEADS, q_len, DIM, generator=generator)
    query = torch.randn(BATCH, KV_HEADS * GROUP, q_len, DIM, generator=generator)
    cache.update(key, value, 0)
    cache.attend(0, query, key, value, None, SCALE)
    return query, key


def _recalled_mass_by_hand(query, key, slot_keys, slot_index):
    """[B, H]: the probability mass the step's queries gave to the recall columns (the last R slots),
    by the softmax over the attended slots and the new tokens (causal), summed over query heads and rows."""
    q_len = key.shape[2]
    grouped = query.view(BATCH, KV_HEADS, GROUP * q_len, DIM)
    slot_logits = (grouped @ slot_keys.transpose(-1, -2)) * SCALE
    slot_logits = slot_logits.masked_fill((slot_index < 0).unsqueeze(2), float("-inf"))
    new_logits = (grouped @ key.transpose(-1, -2)) * SCALE
    row = torch.arange(GROUP * q_len) % q_len  # the token each query row belongs to
    new_logits = new_logits.masked_fill(torch.arange(q_len).view(1, -1) > row.view(-1, 1), float("-inf"))
    probs = torch.cat([slot_logits, new_logits], dim=-1).softmax(dim=-1)
    return probs[..., HOT:slot_keys.shape[2]].sum(dim=(-1, -2))


def test_attention_mass_on_recalled_tokens_is_the_softmax_by_hand(seed, monkeypatch):
    generator = torch.Generator().manual_seed(seed)
    cache = _cache()
    _step(cache, 12, generator)  # 4 tokens per (sequence, head) go cold
    layer = cache.layers[0]
    assert layer.tier.recalled_mass.abs().sum() == 0  # nothing was cold when the chunk attended
    want_recalled = torch.zeros(BATCH, KV_HEADS)
    steps = [3, *[1] * 8]
    attended = []  # the recall columns (frames and staging page) as each step attended them:
    counted = layer.tier.before_insert  # read after the attention, before the eviction stages its victim

    def spy(layer_):
        attended.append((layer.keys[:, :, HOT:].clone(), layer.tier.recalled_token_index().clone()))
        counted(layer_)

    monkeypatch.setattr(layer.tier, "before_insert", spy)
    for q_len in steps:
        hot_keys, hot_index = layer.keys[:, :, :HOT].clone(), layer.token_index[:, :, :HOT].clone()
        query, key = _step(cache, q_len, generator)
        recall_keys, recall_index = attended[-1]
        slot_keys = torch.cat([hot_keys, recall_keys], dim=2)
        slot_index = torch.cat([hot_index, recall_index], dim=2)
        assert bool((recall_index >= 0).any())
        want_recalled += _recalled_mass_by_hand(query, key, slot_keys, slot_index)
    torch.testing.assert_close(layer.tier.recalled_mass, want_recalled, atol=1e-5, rtol=1e-5)
    every_query_row = GROUP * (12 + sum(steps))
    torch.testing.assert_close(layer.tier.attended_mass, torch.full((BATCH, KV_HEADS), float(every_query_row)))
    stats = cache.tier_stats()
    assert stats.recalled_mass == pytest.approx(float(want_recalled.sum()), rel=1e-5)
    assert stats.attended_mass == pytest.approx(every_query_row * BATCH * KV_HEADS)
    assert 0 < stats.recalled_share < 1


@pytest.mark.parametrize("cold_limit", [None, 6])
def test_tier_stats_count_what_the_cold_stores_hold(seed, cold_limit):
    generator = torch.Generator().manual_seed(seed)
    cache = _cache(cold_limit=cold_limit)
    _step(cache, 10, generator)
    for _ in range(11):
        _step(cache, 1, generator)
    evicted = 21 - HOT  # per (sequence, head): every token the hot slots no longer hold
    flushed = evicted - 1  # the last decode step's victim waits on the staging page (P = 2)
    stats = cache.tier_stats()
    layer = cache.layers[0]
    cold = layer.tier.cold
    if cold_limit is None:
        dropped = 0
    else:  # a ring of ceil(6 / 2) = 3 pages: the newest page holds the last odd token
        held_pages = 3
        dropped = (-(-flushed // PAGE) - held_pages) * PAGE
    assert stats.dropped_tokens == dropped * BATCH * KV_HEADS
    # cold + staged + hot == fed
    staged = int(layer.tier.staging.held().sum())
    assert staged == BATCH * KV_HEADS and stats.staged_tokens == staged
    assert stats.cold_tokens + stats.staged_tokens == (evicted - dropped) * BATCH * KV_HEADS
    assert stats.cold_pages == -(-(flushed - dropped) // PAGE) * BATCH * KV_HEADS
    assert stats.host_bytes == sum(getattr(cold, n).numel() * getattr(cold, n).element_size()
                                   for n in ("keys", "values", "token_index", "encoded", "positions"))
    # (the exact selector on a CPU scores the cold store's own keys: no bytes of its own, ``recall.cold_keys``)
    assert stats.digest_device_bytes == layer.tier.digest.nbytes() == 0
    assert stats.pages_copied == int(layer.tier.frames.copied.sum()) > 0
    layer_stats = cache.layer_stats()[0]
    assert layer_stats.capacity == HOT + RECALL and HOT < layer_stats.held <= HOT + RECALL
    record = cache.tier_record()
    assert record["cold_host_bytes"] == stats.host_bytes and record["pages_copied"] == stats.pages_copied


def test_stats_start_over_with_the_layer(seed):
    generator = torch.Generator().manual_seed(seed)
    cache = _cache()
    _step(cache, 12, generator)
    _step(cache, 1, generator)
    assert cache.tier_stats().attended_mass > 0
    cache.reset()
    assert cache.layers[0].tier.recalled_mass is None
    _step(cache, 3, generator)
    stats = cache.tier_stats()
    assert (stats.attended_mass, stats.recalled_mass, stats.cold_tokens) == (GROUP * 3 * BATCH * KV_HEADS, 0.0, 0)
