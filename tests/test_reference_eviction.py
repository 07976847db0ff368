"""The eviction the CPU runs is ``h2ochat_kernels/reference.py``'s, and that reference is right.

``H2OLayer`` on the torch backend calls ``reference.evict_and_insert`` itself (the Triton kernels are
tested against the same function in test_kernels.py), and the reference is held here to a slow,
obvious loop over (sequence, KV head): the lowest priority goes, ties to the lowest slot, the new
token is written there, an inactive row writes nothing and reports nothing dropped.
"""

from __future__ import annotations

import pytest
import torch

from h2ochat_kernels import reference


def _slow_evict(priority, buffers, new, active):
    """One (sequence, head) at a time, in plain Python."""
    batch, heads, slots = priority.shape
    dropped = torch.full((batch, heads), -1, dtype=torch.long)
    dropped_score = torch.zeros(batch, heads)
    for b in range(batch):
        if active is not None and not bool(active[b]):
            continue
        for h in range(heads):
            values = priority[b, h].tolist()
            slot = values.index(min(values))  # the first of the lowest
            dropped[b, h] = buffers["token_index"][b, h, slot]
            dropped_score[b, h] = buffers["scores"][b, h, slot]
            buffers["keys"][b, h, slot] = new["key"][b, h, 0]
            buffers["values"][b, h, slot] = new["value"][b, h, 0]
            buffers["scores"][b, h, slot] = new["score"][b, h]
            buffers["token_index"][b, h, slot] = new["token_index"][b]
            buffers["positions"][b, h, slot] = new["position"][b]
            buffers["value_norm"][b, h, slot] = new["value_norm"][b, h]
    return dropped, dropped_score


@pytest.mark.parametrize("with_active", [False, True])
def test_the_reference_eviction_is_the_obvious_loop(seed, with_active):
    generator = torch.Generator().manual_seed(seed)
    batch, heads, slots, dim = 3, 2, 7, 4
    # few distinct priorities, so ties are common; some slots protected (+inf) or empty (-inf)
    priority = torch.randint(0, 4, (batch, heads, slots), generator=generator).float()
    priority[torch.rand(priority.shape, generator=generator) < 0.2] = float("inf")
    priority[torch.rand(priority.shape, generator=generator) < 0.1] = float("-inf")
    buffers = {
        "keys": torch.randn(batch, heads, slots, dim, generator=generator),
        "values": torch.randn(batch, heads, slots, dim, generator=generator),
        "scores": torch.rand(batch, heads, slots, generator=generator),
        "token_index": torch.randint(-1, 50, (batch, heads, slots), generator=generator),
        "positions": torch.randint(-1, 50, (batch, heads, slots), generator=generator),
        "value_norm": torch.rand(batch, heads, slots, generator=generator),
    }
    new = {"key": torch.randn(batch, heads, 1, dim, generator=generator),
           "value": torch.randn(batch, heads, 1, dim, generator=generator),
           "score": torch.rand(batch, heads, generator=generator),
           "token_index": torch.randint(50, 60, (batch,), generator=generator),
           "position": torch.randint(50, 60, (batch,), generator=generator),
           "value_norm": torch.rand(batch, heads, generator=generator)}
    active = torch.rand(batch, generator=generator) < 0.5 if with_active else None
    want = {name: tensor.clone() for name, tensor in buffers.items()}
    want_dropped, want_score = _slow_evict(priority, want, new, active)
    got = {name: tensor.clone() for name, tensor in buffers.items()}
    dropped, score = reference.evict_and_insert(
        priority, got["keys"], got["values"], got["scores"], got["token_index"], got["positions"], new["key"],
        new["value"], new["score"], new["token_index"], new["position"], got["value_norm"], new["value_norm"], active)
    assert torch.equal(dropped, want_dropped)
    assert torch.equal(score, want_score)
    for name in buffers:
        assert torch.equal(got[name], want[name]), name
    # the victim a tier is handed is the slot the write then overwrites
    assert torch.equal(reference.lowest_slots(priority), priority.argmin(dim=-1))


def test_the_cpu_decode_step_runs_the_reference_eviction(monkeypatch):
    """A decode step on the CPU evicts through ``reference.evict_and_insert`` (not a copy of it)."""
    from h2ochat.kv import H2OCache

    calls = []
    original = reference.evict_and_insert
    monkeypatch.setattr(reference, "evict_and_insert", lambda *a, **k: calls.append(1) or original(*a, **k))
    cache = H2OCache(2, "h2o", 4, max_positions=100)
    for _ in range(7):  # 4 fill the slots (in place, through the same route), 3 evict
        cache.position_ids(1, 1)
        for layer in range(2):
            cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), layer)
            pending = cache.layers[layer]
            cache.attend(layer, torch.randn(1, 2, 1, 8), pending.pending_key, pending.pending_value, None, 0.3)
    assert cache.layers[0].kernels.name == "torch"
    assert cache.evicted_tokens() == 2 * 2 * 3
    assert len(calls) >= 2 * 3  # every evicting step of every layer
