"""The cold store's zero-copy route (``triton_rows`` kernels writing and reading the host buffers,
its count on the device) against its torch route, under the Triton interpreter on the CPU: the same
appends leave the same buffers, the same pages come back, and a two-tier cache gives the same logits."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import VOCAB, build_model, recall_cache, triton_interpreter_ready

from h2ochat.engine.attention import use_h2o_attention
from h2ochat.engine.forward_step import forward
from h2ochat.engine.generation import max_positions
from h2ochat.recall import cold_store as cs
from h2ochat.recall import tier, tiered
from h2ochat.rotary import Rotary, find_rotary

pytestmark = pytest.mark.skipif(not triton_interpreter_ready(), reason="needs TRITON_INTERPRET=1 before triton's import")


def _random_appends(g, store_pair, steps, batch, heads, dim):
    counter = 0
    for _ in range(steps):
        width = int(torch.randint(1, 4, (1,), generator=g))
        keys = torch.randn(batch, heads, width, dim, generator=g)
        values = torch.randn(batch, heads, width, dim, generator=g)
        valid = torch.rand(batch, heads, width, generator=g) < 0.7
        index = torch.arange(counter, counter + width).expand(batch, heads, width).masked_fill(~valid, -1)
        counter += width
        for store in store_pair:
            store.append(keys, values, index, index.clamp(min=0) * 2, encoded=index.clamp(min=0))  # moved: rotated back


@pytest.mark.parametrize("cold_dtype", ["same", "int8-values", "int8"])
@pytest.mark.parametrize("limit", [None, 8])
def test_zero_copy_store_equals_the_torch_store(seed, cold_dtype, limit):
    g = torch.Generator().manual_seed(seed)
    batch, heads, dim, page = 2, 3, 6, 4
    make = functools.partial(cs.ColdStore, batch, heads, dim, dim, page, torch.float32, cold_dtype=cold_dtype,
                             limit=limit, initial_pages=1)
    plain, zero = make(zero_copy=False), make(zero_copy=True)
    _random_appends(g, (plain, zero), 9, batch, heads, dim)
    assert torch.equal(plain.count, zero.count)
    for name in plain._buffers():  # the spill slot holds whatever the last invalid entry left: not compared
        assert torch.equal(getattr(plain, name)[:, :, :plain.capacity], getattr(zero, name)[:, :, :zero.capacity]), name
    wanted = torch.randint(-1, int(plain.count.max()) // page + 1, (batch, heads, 2), generator=g)
    rotary = Rotary(torch.rand(dim // 2, generator=g), dim)
    for a, b in zip(plain.pages(wanted, rotary), zero.pages(wanted, rotary)):
        assert torch.equal(a, b)


def test_a_cache_on_the_zero_copy_route_gives_the_same_logits(monkeypatch, family, seed):
    model = build_model(family, seed=seed, max_position_embeddings=256)
    ids = torch.randint(3, VOCAB, (1, 40))
    use_h2o_attention(model)

    def run(zero_copy: bool):
        monkeypatch.setattr(tier, "ColdStore", functools.partial(cs.ColdStore, zero_copy=zero_copy))
        cache = recall_cache(model.config.num_hidden_layers, "h2o", 12, recall=tiered.RecallConfig(8, 4, "int4"),
                             max_positions=max_positions(model.config), rotary=find_rotary(model))
        pieces = [ids[:, :20], *[ids[:, i : i + 1] for i in range(20, 40)]]
        return torch.cat([forward(model, cache, piece, logits_to_keep=1)[:, -1] for piece in pieces]), cache

    want, plain = run(False)
    got, zero = run(True)
    assert zero.layers[0].tier.cold.zero_copy and not plain.layers[0].tier.cold.zero_copy
    torch.testing.assert_close(got, want)
    assert plain.tier_stats().cold_tokens == zero.tier_stats().cold_tokens > 0
