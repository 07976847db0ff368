"""``H2OCache.prefix(rows)``: a cache over the first rows of another, sharing its slots.

A decode step on the prefix must equal the same step on the whole cache with the other rows left
out (the ``active`` mask), write only the prefix's rows of the shared storage, and hand the host
counters back so the whole cache goes on as if it had run the step itself.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build_model
from lockstep import prefix_against_masked

from h2ochat.engine.forward_step import forward
from h2ochat.engine.generation import CacheSettings
from h2ochat.kv import CacheShapeError

ROWS, PREFIX = 4, 2


def _prefilled(model, prompt):
    cache = CacheSettings(policy="h2o", budget="10").build(model, static_shapes=True)
    forward(model, cache, prompt, logits_to_keep=1)
    return cache


@pytest.mark.parametrize("family", ["opt", "llama", "neox"])
def test_a_prefix_step_is_the_masked_step_of_the_whole_cache(family, seed):
    model = build_model(family, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (ROWS, 14), generator=generator)
    steps = torch.randint(3, VOCAB, (6, PREFIX), generator=generator)
    masked, shared = _prefilled(model, prompt), _prefilled(model, prompt)
    view = shared.prefix(PREFIX)
    untouched = [{name: tensor[PREFIX:].clone() for name, tensor in layer.state_tensors().items()}
                 for layer in shared.layers]

    # the two runs batch 2 and 4 rows: their sums may round apart in the last bit, so a near-tie of
    # two slots' priorities may keep different tokens (tests/lockstep.py stops there)
    compared = prefix_against_masked(model, view, masked, steps)
    for mine, kept in zip(shared.layers, untouched):
        for name, tensor in mine.state_tensors().items():
            assert torch.equal(tensor[PREFIX:], kept[name]), name  # the rows outside the prefix: not a bit changed
    assert shared.evicted_tokens() > 0
    if compared < 6:
        return  # a legitimate near-tie; everything up to it agreed
    for mine, ref in zip(shared.layers, masked.layers):
        for name, tensor in mine.state_tensors().items():
            torch.testing.assert_close(tensor[:PREFIX], ref.state_tensors()[name][:PREFIX], atol=1e-5, rtol=1e-5)
    assert torch.equal(shared.tokens_fed[:PREFIX], masked.tokens_fed[:PREFIX])
    assert shared.host_counters().layers == masked.host_counters().layers


def test_only_an_allocated_cache_has_prefixes():
    model = build_model("llama")
    with pytest.raises(CacheShapeError):
        CacheSettings(policy="h2o", budget="10").build(model).prefix(1)  # nothing allocated yet
    with pytest.raises(CacheShapeError):
        CacheSettings(policy="h2o", budget="16", recall="8", page=4).build(model).prefix(1)
    # (a recall cache's prefixes: tests/test_recall_prefix.py)
