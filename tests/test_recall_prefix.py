"""A recall cache's prefix (``H2OCache.prefix``: a server's bucket of its first rows, issue 34's "free rows
are skipped with recall too"): its layers step the whole cache's tiers (``TierSpec.row_prefixes``), so a
decode step of the first rows must equal the step of the whole cache with the other rows left out
(``active``), on the C route and the torch route, float and int8 slots, through flushes of the staging
page, choices of pages and the cold store's growth; the rows after the prefix must come out of it with not
a bit changed, and both caches' host clocks (``row_cadence``) must agree.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build_model
from lockstep import prefix_against_masked

from h2ochat.engine.forward_step import forward
from h2ochat.engine.generation import CacheSettings
from h2ochat.kv import CacheShapeError
from h2ochat_kernels import dispatch

ROWS, PREFIX, PROMPT, STEPS = 4, 2, 26, 14
ROUTES = {  # name: (settings, whether the C routes run; "gpu": the torch route that reads nothing back)
    "c": (dict(recall="8", page=4), True),
    "torch": (dict(recall="8", page=4), False),
    "gpu": (dict(recall="8", page=4), "gpu"),
    "torch-every2": (dict(recall="8", page=4, recall_every=2), False),
    "int8-slots": (dict(recall="8", page=4, kv_dtype="int8"), True),
    "rest-c": (dict(recall="8", page=4, recall_rest="pages"), True),  # (the rest column every step)
    "rest-torch": (dict(recall="8", page=4, recall_rest="pages"), False),
}


def _flipped(mine, ref) -> bool:
    """Whether 8-bit codes of the prefix's rows (int8 slots, the cold store's int8 values) came out another
    code in one cache than in the other (the two batches' sums rounded apart, a value on a code's edge):
    they attend, store and recall values a code step apart from then on."""
    return any(not torch.equal(tensor[:PREFIX], b.state_tensors()[name][:PREFIX])
               for a, b in zip(mine.layers, ref.layers) for name, tensor in a.state_tensors().items()
               if tensor.dtype in (torch.int8, torch.uint8))


def _tolerance(mine, ref) -> tuple[float, float]:
    """The logits' (atol, rtol)."""
    return (2e-2, 2e-2) if _flipped(mine, ref) else (1e-4, 1e-4)


def _prefilled(model, prompt, settings):
    cache = CacheSettings(policy="h2o", budget="16", **settings).build(model, static_shapes=True)
    forward(model, cache, prompt, logits_to_keep=1)
    return cache


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("family", ["opt", "llama", "neox"])
def test_a_recall_prefix_step_is_the_masked_step_of_the_whole_cache(family, route, seed, monkeypatch):
    settings, c_routes = ROUTES[route]
    if c_routes is not True:
        monkeypatch.setenv(dispatch.CPU_SWITCH, "none")
    if c_routes == "gpu":  # (a GPU's step reads no plan back: ``recall.step.host_reads_allowed``)
        from h2ochat.recall import step, tier

        for module in (step, tier):
            monkeypatch.setattr(module, "host_reads_allowed", lambda state: False)
    model = build_model(family, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (ROWS, PROMPT), generator=generator)
    steps = torch.randint(3, VOCAB, (STEPS, PREFIX), generator=generator)
    masked, shared = _prefilled(model, prompt, settings), _prefilled(model, prompt, settings)
    view = shared.prefix(PREFIX)
    assert all(mine.tier is theirs.tier for mine, theirs in zip(view.layers, shared.layers))
    untouched = [{name: tensor[PREFIX:].clone() for name, tensor in layer.state_tensors().items()}
                 for layer in shared.layers]
    chosen = {"prefix": 0}
    choose = type(shared.layers[0].tier).recall

    def counted(tier, port, queries, *args, **kwargs):
        if tier is shared.layers[0].tier and queries.shape[0] == PREFIX:
            chosen["prefix"] += 1
        return choose(tier, port, queries, *args, **kwargs)

    monkeypatch.setattr(type(shared.layers[0].tier), "recall", counted)

    compared = prefix_against_masked(model, view, masked, steps, tolerance=lambda: _tolerance(shared, masked),
                                     where=f"{family} {route}")
    assert chosen["prefix"] > 0  # (the steps chose pages for the prefix's rows)
    for mine, ref, kept in zip(shared.layers, masked.layers, untouched):
        theirs = ref.state_tensors()
        for name, tensor in mine.state_tensors().items():
            assert tensor.shape == theirs[name].shape, name  # (the stores grew alike)
            # the rows after the prefix: not a bit changed (as far as they reached before a store grew)
            assert torch.equal(tensor[PREFIX:][tuple(slice(0, size) for size in kept[name].shape)], kept[name]), name
        assert mine.tier.cadence.steps == ref.tier.cadence.steps
        assert mine.tier.staging.steps == ref.tier.staging.steps
    tier = shared.layers[0].tier
    assert int(tier.cold.count[:PREFIX].min()) > int(masked.layers[0].tier.cold.count[PREFIX:].max())  # (flushed)
    if compared < STEPS:
        return  # a legitimate near-tie of two slots' priorities; everything up to it agreed
    # (a code step: the cold store's floats of int8 slots come from codes that may have flipped and left)
    close = 0.1 if shared.layers[0].format.quantized or _flipped(shared, masked) else 1e-4
    if tier.cold.keys.dtype == torch.bfloat16 and tier.cold.dtype == torch.float32:
        # (an fp32 model's cold keys in bf16: keys the two steps computed an fp32 rounding apart can round to
        # neighbouring bf16 values, 2**-8 apart, in the store and in the recall slots a page comes back to)
        close = max(close, 2 ** -7)
    for mine, ref in zip(shared.layers, masked.layers):
        theirs = ref.state_tensors()
        for name, tensor in mine.state_tensors().items():
            if tensor.is_floating_point():
                torch.testing.assert_close(tensor[:PREFIX], theirs[name][:PREFIX], atol=close, rtol=close,
                                           msg=lambda m: f"{name}: {m}")
            elif tensor.dtype in (torch.uint8, torch.int8):  # (int8 slots' codes: a rounding apart, one code)
                assert int((tensor[:PREFIX].int() - theirs[name][:PREFIX].int()).abs().max()) <= 1, name
            else:
                assert torch.equal(tensor[:PREFIX], theirs[name][:PREFIX]), name
    assert torch.equal(shared.tokens_fed, masked.tokens_fed)
    assert shared.host_counters().layers == masked.host_counters().layers


def test_a_recall_prefix_takes_decode_steps_only(seed):
    model = build_model("llama", seed=seed)
    cache = _prefilled(model, torch.randint(3, VOCAB, (ROWS, PROMPT), generator=torch.Generator().manual_seed(seed)),
                       ROUTES["c"][0])
    view = cache.prefix(PREFIX)
    with pytest.raises(ValueError, match="decode steps"):
        forward(model, view, torch.randint(3, VOCAB, (PREFIX, 3)), logits_to_keep=1)
    view.layers[0].reset()  # (a prefix's layer leaves the tier it shares alone)
    assert cache.layers[0].tier.cold is not None


def test_a_tier_that_steps_every_row_has_no_prefix(tmp_path):
    from disk_tier import DiskSpec

    model = build_model("llama")
    cache = CacheSettings(policy="h2o", budget="16").build(model)
    cache.use_tier(DiskSpec(tmp_path))
    forward(model, cache, torch.randint(3, VOCAB, (2, 20)), logits_to_keep=1)
    assert not cache.row_prefixes
    with pytest.raises(CacheShapeError):
        cache.prefix(1)


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("family", ["opt", "llama", "neox"])
def test_a_running_row_moved_down_goes_on_as_in_its_own_row(family, every, seed):
    """A server packs its rows in use at the front (``H2OCache.move_row``): a row moved mid-generation, its
    staging page part full and its cadence mid-count, goes on as it would have in its own row (not as a
    resumed conversation, whose staging page is folded into its cold store)."""
    model = build_model(family, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (2, PROMPT), generator=generator)
    tokens = torch.randint(3, VOCAB, (STEPS, 2), generator=generator)
    settings = dict(ROUTES["c"][0], recall_every=every)
    moved, kept = _prefilled(model, prompt, settings), _prefilled(model, prompt, settings)
    for step in range(6):  # (both rows: a page of 4 flushed, 2 staged since)
        for cache in (moved, kept):
            forward(model, cache, tokens[step].view(-1, 1), logits_to_keep=1)
    moved.move_row(1, 0)
    assert moved.layers[0].tier.cadence.steps[0] == kept.layers[0].tier.cadence.steps[1] > 0
    for step in range(6, STEPS):
        token = tokens[step, 1].expand(2, 1)  # (row 1's tokens, fed to the row it is in now)
        mine = forward(model, moved, token, logits_to_keep=1, active=torch.tensor([True, False]))
        theirs = forward(model, kept, token, logits_to_keep=1, active=torch.tensor([False, True]))
        torch.testing.assert_close(mine[0], theirs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(moved.layers, kept.layers):
        assert a.tier.cadence.steps[0] == b.tier.cadence.steps[1]
        assert torch.equal(a.tier.cold.count[0], b.tier.cold.count[1])
        assert torch.equal(a.token_index[0], b.token_index[1])  # (hot, recalled and staged tokens alike)
    assert int((moved.layers[0].token_index[1] >= 0).sum()) == 0  # (the row it left: emptied)
