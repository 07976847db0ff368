"""``CacheSettings.build_for`` (``generate``): a text known to end within the policy's own slots gets a
cache without recall, which gives the same logits as the cache with recall (nothing is evicted, so
nothing could be recalled); one token more and recall stays. For every family."""

from __future__ import annotations

import torch

from h2ochat.engine.generation import CacheSettings, forward, prefill
from h2ochat.kv.tier import NO_TIER

from conftest import build_model, random_ids

# 32 slots, 16 of them recall's (two pages of 8): the policy keeps 16
SETTINGS = CacheSettings(budget="32", recall="16")


def logits_through(model, cache, ids, prompt: int) -> torch.Tensor:
    with torch.inference_mode():
        logits = [prefill(model, cache, ids[:, :prompt])]
        logits += [forward(model, cache, ids[:, t:t + 1])[:, -1] for t in range(prompt, ids.shape[1])]
    return torch.stack(logits, 1)


def test_a_text_within_the_policys_slots_leaves_recall_out_and_changes_nothing(family):
    model = build_model(family, seed=1)
    ids = random_ids(1, 16, torch.Generator().manual_seed(2))
    cache, left_out = SETTINGS.build_for(model, 16)
    assert left_out and cache.tier is NO_TIER
    with_recall = SETTINGS.build(model)
    assert with_recall.tier is not NO_TIER
    assert torch.equal(logits_through(model, cache, ids, 10), logits_through(model, with_recall, ids, 10))


def test_one_token_past_the_policys_slots_keeps_recall():
    model = build_model("llama", seed=1)
    cache, left_out = SETTINGS.build_for(model, 17)
    assert not left_out and cache.tier is not NO_TIER
    off = CacheSettings(budget="32")
    assert off.build_for(model, 4)[1] is False  # no recall asked for: nothing to leave out
