"""A cache's memory goes back when its last reference goes, without Python's cycle collector (issue 34).

A layer that held a bound method of its own (its eviction route) and a tier port that held its layer's
made every cache a reference cycle: its slots and cold stores were freed only when the cycle collector
next ran. A server makes a 1-row cache for every prompt it reads; at the end of the 8 x 4 recall chat
load ~230 MB of them were still waiting to be collected (``benchmarks/serve_memory_timeline.py``). Each
case here drops its cache with the collector off and checks that the cache and a buffer of its are gone.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import VOCAB, build_model, recall_cache

from h2ochat.engine.forward_step import forward
from h2ochat.engine.generation import max_positions
from h2ochat.kv import H2OCache
from h2ochat.recall.tiered import RecallConfig
from h2ochat.rotary import find_rotary

SLOTS = 12


def _cache(model, kind: str, rows: int = 1) -> H2OCache:
    layers = model.config.num_hidden_layers
    common = dict(max_positions=max_positions(model.config), positions="absolute", rotary=find_rotary(model))
    if kind == "recall":
        return recall_cache(layers, "h2o", SLOTS, recall=RecallConfig(8, 4, "rot4"), **common)
    if kind == "recall-static":  # (the compiled step's kind: static shapes, the tier held by ``graph_choice``)
        return recall_cache(layers, "h2o", SLOTS, recall=RecallConfig(8, 4, "rot4"), static_shapes=True, **common)
    if kind == "int8":
        return H2OCache(layers, "h2o", SLOTS, kv_dtype="int8", **common)
    if kind == "full":
        return H2OCache(layers, "full", 64, **common)
    return H2OCache(layers, kind, SLOTS, **common)


def _filled(model, kind: str, rows: int = 1) -> H2OCache:
    """A cache of ``kind`` that read a prompt past its slots (evicting, so a recall tier's cold store
    holds tokens) and decoded a few tokens."""
    cache = _cache(model, kind, rows)
    generator = torch.Generator().manual_seed(0)
    forward(model, cache, torch.randint(3, VOCAB, (rows, 30), generator=generator), logits_to_keep=1)
    for _ in range(3):
        forward(model, cache, torch.randint(3, VOCAB, (rows, 1), generator=generator), logits_to_keep=1)
    return cache


def _watched(cache: H2OCache) -> list[weakref.ref]:
    """Weak references to the cache, its first layer and every tensor that layer updates in place."""
    layer = cache.layers[0]
    return [weakref.ref(cache), weakref.ref(layer), *(weakref.ref(t) for t in layer.state_tensors().values())]


@pytest.fixture
def collector_off():
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was:
        gc.enable()


@pytest.mark.parametrize("kind", ["h2o", "int8", "full", "recall", "recall-static"])
def test_a_dropped_cache_is_freed_at_once(family, kind, collector_off):
    model = build_model(family, seed=0, max_position_embeddings=256)
    cache = _filled(model, kind)
    watched = _watched(cache)
    assert len(watched) > 3
    del cache
    alive = [ref() for ref in watched if ref() is not None]
    assert not alive, f"{len(alive)} of the {kind} cache's objects wait for the cycle collector"


def test_a_prefix_and_a_moved_row_leave_nothing_behind(family, collector_off):
    """A server's ways with caches: a prefix of rows over a batch cache (the decode buckets), and a row
    exported from one cache and imported into another (a prompt read, then parked)."""
    model = build_model(family, seed=0, max_position_embeddings=256)
    batch = _filled(model, "h2o", rows=4)
    prefix = batch.prefix(2)
    watched = _watched(prefix) + _watched(batch)
    del prefix, batch
    assert not [ref() for ref in watched if ref() is not None]

    source, target = _filled(model, "recall"), _filled(model, "recall", rows=2)
    target.import_row(1, source.export_row(0))
    watched = _watched(source) + _watched(target)
    del source, target
    assert not [ref() for ref in watched if ref() is not None]
