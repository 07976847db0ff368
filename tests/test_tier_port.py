"""Issue 33, items 2 and 4: the tier port (a tier reads and writes its own columns through it, and a
second tier plugs in through it alone: tests/disk_tier.py), the one host-counter object a cache
shares with its prefix views, and the cache's kind handed down with each step."""

from __future__ import annotations

import torch

from disk_tier import DiskSpec

from h2ochat.kv import H2OCache
from h2ochat.kv.full import BOUNDED
from h2ochat.recall.spec import RecallSpec
from h2ochat.recall.tiered import RecallConfig

HEADS, DIM = 2, 8


def drive(cache: H2OCache, steps: list[int], generator: torch.Generator) -> list[torch.Tensor]:
    """Feed ``cache`` (2 layers) steps of these many tokens with random keys, values and queries;
    returns the keys fed to layer 0, one [1, H, Q, D] per step."""
    fed = []
    for q_len in steps:
        cache.position_ids(1, q_len)
        for layer in range(len(cache.layers)):
            key, value, query = (torch.randn(1, HEADS, q_len, DIM, generator=generator) for _ in range(3))
            if layer == 0:
                fed.append(key)
            cache.update(key, value, layer)
            pending = cache.layers[layer]
            cache.attend(layer, query, pending.pending_key, pending.pending_value, None, 0.3)
    return fed


def test_a_second_tier_plugs_in_through_the_port_alone(tmp_path, seed):
    """The disk tier sees every evicted token once, with the key it was fed, before it is gone; the
    cache evicts exactly as a plain one does (the tier's route changes no choice)."""
    steps = [10] + [1] * 15
    plain = H2OCache(2, "h2o", 6, max_positions=1000)
    disk = H2OCache(2, "h2o", 6, max_positions=1000, tier=DiskSpec(tmp_path))
    drive(plain, steps, torch.Generator().manual_seed(seed))
    fed = torch.cat(drive(disk, steps, torch.Generator().manual_seed(seed)), dim=2)  # [1, H, 25, D]
    for mine, theirs in zip(disk.layers, plain.layers):
        assert torch.equal(mine.token_index, theirs.token_index)
        assert torch.equal(mine.scores, theirs.scores)
    tier = disk.layers[0].tier
    assert tier.written > 0
    for head in range(HEADS):
        archived = tier.tokens(0, head)
        held = {int(t) for t in disk.layers[0].token_index[0, head] if t >= 0}
        assert len(archived) == len(set(archived)) and not held & set(archived)
        assert held | set(archived) == set(range(sum(steps)))
    first = torch.load(sorted((tmp_path / "layer0").glob("*.pt"))[0])  # the prefill chunk's drops
    dropped = first["token_index"][0, 0]
    for where in (dropped >= 0).nonzero().flatten().tolist():
        assert torch.equal(first["keys"][0, 0, where], fed[0, 0, int(dropped[where])])


def test_the_port_says_where_the_tier_columns_are(seed):
    """A recall tier's columns are views of the layer's slots after the policy's: its frames, then
    the staging page (its last page); ``policy_part``/``tier_part`` split a per-slot tensor there."""
    cache = H2OCache(1, "h2o", 12, max_positions=1000, tier=RecallSpec(RecallConfig(slots=8, page=4)))
    cache.allocate(1, HEADS, DIM, dtype=torch.float32, device="cpu")
    layer = cache.layers[0]
    port = layer.port
    assert (port.capacity, port.columns) == (12, 8) and layer.columns == 20
    staging, frames = port.staging_columns(4), port.frame_columns(4)
    assert staging["keys"].data_ptr() == layer.keys[:, :, 16:].data_ptr()
    assert frames["token_index"].data_ptr() == layer.token_index[:, :, 12:].data_ptr()
    assert frames["keys"].shape[2] == staging["keys"].shape[2] == 4
    assert layer.tier.staging.slots.keys.data_ptr() == staging["keys"].data_ptr()
    index = torch.arange(20)
    assert torch.equal(port.policy_part(index), index[:12]) and torch.equal(port.tier_part(index), index[12:])
    slot = torch.full((1, HEADS), 3)
    layer.token_index[0, :, 3] = torch.tensor([7, 9])
    assert port.victims(slot)["token_index"].tolist() == [[7, 9]]


def test_a_prefix_view_shares_the_host_counters(seed):
    """A step of a bucket's view advances the counters of the cache it views, and the other way
    round, with nothing handed over (the server copied them before and after every step)."""
    cache = H2OCache(2, "h2o", 6, max_positions=1000)
    cache.allocate(4, HEADS, DIM, dtype=torch.float32, device="cpu")
    view = cache.prefix(2)
    assert view.host is cache.host
    assert all(mine.counters is theirs.counters for mine, theirs in zip(view.layers, cache.layers))
    generator = torch.Generator().manual_seed(seed)
    for _ in range(3):
        view.position_ids(2, 1)
        for index in range(2):
            key, value, query = (torch.randn(2, HEADS, 1, DIM, generator=generator) for _ in range(3))
            view.update(key, value, index)
            view.attend(index, query, key, value, None, 0.3)
    assert cache.host_counters() == view.host_counters()
    assert cache.layers[1].host_counters() == (3, 3) and cache.largest_next_position == 3
    saved = cache.host_counters()
    cache.layers[0].set_host_counters(5, 5)
    assert view.layers[0].slots_in_use == 5
    view.restore_host_counters(saved)
    assert cache.host_counters() == saved


def test_the_kind_rides_with_the_step_not_on_the_layer(seed):
    """``keep_columns`` makes a full cache step as a bounded one: the layers are handed the kind with
    each step (``StepContext.kind``) and hold none of their own."""
    cache = H2OCache(1, "full", 4, max_positions=1000)
    assert not hasattr(cache.layers[0], "kind")
    drive(cache, [3], torch.Generator().manual_seed(seed))
    assert cache.context.kind.grows and cache.get_max_length() == -1
    cache.reset()
    cache.allocate(1, HEADS, DIM, dtype=torch.float32, device="cpu")
    cache.keep_columns()
    assert cache.kind is BOUNDED and cache.get_max_length() == 4
    drive(cache, [2, 1, 1], torch.Generator().manual_seed(seed))  # fills its 4 columns, never grows
    assert cache.context.kind is BOUNDED and cache.layers[0].keys.shape[2] == 4
