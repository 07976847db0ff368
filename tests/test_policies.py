"""Policies as objects: a new one is one definition, knobs parse, budgets split and shape as declared."""

from __future__ import annotations

import pytest
import torch

from h2ochat.measure import evaluation as ev
from h2ochat import policies
from h2ochat.kv import H2OCache
from h2ochat.policies import POLICIES, Policy, get_policy, parse_policy


class KeepEvenTokens(Policy):
    """A made-up policy: odd token indices go first, whatever their scores; then the oldest."""

    def rank(self, scores, token_index, newest, value_norm=None, generator=None):
        return (token_index % 2 == 0).float() * 1000 + token_index.float()


def _drive(cache, steps, batch=1, kv_heads=2, group=2, dim=8, generator=None):
    for _ in range(steps):
        for layer_idx in range(len(cache.layers)):
            key = torch.randn(batch, kv_heads, 1, dim, generator=generator)
            cache.update(key, torch.randn(batch, kv_heads, 1, dim, generator=generator), layer_idx)
            cache.attend(layer_idx, torch.randn(batch, kv_heads * group, 1, dim, generator=generator),
                         key, cache.layers[layer_idx].pending_value, None, 0.3)


def test_a_new_policy_is_one_definition(monkeypatch):
    """Registered once, it gets its own split and ranking everywhere: the cache, eval rows, the CLI's
    name:knob syntax; the one-launch eviction is not used for a rank it cannot express."""
    mine = KeepEvenTokens("even", "keeps even tokens", heavy_ratio=0.75, sinks=1)
    monkeypatch.setitem(POLICIES, "even", mine)
    assert get_policy("even") is mine
    budget = mine.split(9)
    assert (budget.sinks, budget.heavy, budget.recent) == (1, 6, 2)
    assert get_policy("even:sinks=2").split(9).sinks == 2
    assert mine.fused_eviction is None and POLICIES["h2o"].fused_eviction is not None
    cache = H2OCache(1, "even", 9, max_positions=10_000)
    _drive(cache, 30, generator=torch.Generator().manual_seed(0))
    kept = sorted(cache.layers[0].token_index[0, 0].tolist())
    # sink 0, the recent 2 (28, 29), and the 6 newest even tokens among the rest
    assert kept == [0, 16, 18, 20, 22, 24, 26, 28, 29]
    assert ev.build_rows(["full", "even"], [9], tokens=30)[1].policy is mine


def test_knobs_parse_and_refuse_clearly():
    policy = parse_policy("decay:decay=0.5:sinks=2:value_eps=0.01")
    assert (policy.decay, policy.sinks, policy.value_eps) == (0.5, 2, 0.01)
    assert policy.label == "decay:decay=0.5:sinks=2:value_eps=0.01"
    assert get_policy("h2o").label == "h2o"
    for bad, fragment in [("lru", "unknown policy"), ("h2o:colour=red", "knob"), ("h2o:decay=x", "not a number"),
                          ("h2o:decay=1.5", "decay"), ("h2o:heavy_ratio=1", "heavy_ratio")]:
        with pytest.raises(ValueError, match=fragment):
            parse_policy(bad)


def test_paper_split_is_unchanged():
    """h2o keeps the paper's split (and so the README's numbers): heavy = int(C * 0.5), at most C - 1."""
    for slots in range(1, 70):
        budget = get_policy("h2o").split(slots)
        assert budget.heavy == min(int(slots * 0.5), slots - 1) and budget.sinks == 0
        assert budget.heavy + budget.recent == slots


@pytest.mark.parametrize("shape", [0.5, -0.5, 0.25])
def test_layer_shapes_keep_the_total(shape):
    policy = get_policy(f"decay:layer_shape={shape}")
    for slots, layers in [(64, 30), (32, 7), (128, 2)]:
        per_layer = policy.layer_slots(slots, layers)
        assert sum(per_layer) == slots * layers
        assert min(per_layer) >= policy.sinks + 2
        steps = [b - a for a, b in zip(per_layer[:-2], per_layer[1:-1])]  # the last layer absorbs rounding
        assert all(step <= 0 for step in steps) if shape > 0 else all(step >= 0 for step in steps)
    cache = H2OCache(4, policy, 16, max_positions=10_000)
    assert [layer.capacity for layer in cache.layers] == policy.layer_slots(16, 4)


def test_decayed_scores_stay_bounded():
    """S <- decay * S + a, with a <= G per step (G query heads' probabilities): S <= G / (1 - decay),
    however long the text; the paper's plain sum grows with it."""
    group = 2
    bounded = H2OCache(1, "decay:decay=0.9", 8, max_positions=100_000)
    plain = H2OCache(1, "h2o", 8, max_positions=100_000)
    generator = torch.Generator().manual_seed(1)
    _drive(bounded, 300, group=group, generator=generator)
    _drive(plain, 300, group=group, generator=torch.Generator().manual_seed(1))
    assert float(bounded.layers[0].scores.max()) <= group / (1 - 0.9) + 1e-4
    assert float(plain.layers[0].scores.max()) > group / (1 - 0.9)


def test_every_policy_is_described_once():
    described = dict(policies.describe_policies())
    assert set(described) == set(POLICIES) and all(described.values())
