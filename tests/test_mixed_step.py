"""Mixed steps (``engine.mixed_step``): a prompt chunk and the running rows' decode step in one forward.

Against the two forwards run apart (the reference: the server's steps without mixing): the same
logits and the same cache contents, in every family, with a row left out and with a recall tier;
served through the scheduler, the same tokens as a server that never mixes, with mixed steps counted.
The scheduler's side (which step mixes, what a failure fails) runs on the fake backend."""

from __future__ import annotations

import random

import pytest
import torch

from h2ochat.engine.generation import forward, prefill
from h2ochat.engine.mixed_step import mixed_forward
from h2ochat.kv import H2OCache
from h2ochat.serve.scheduler import Scheduler

from conftest import EXACT, FAMILIES, VOCAB, build_model, recall_cache
from serve_fakes import FakeBackend, drain, generated, greedy_alone, make_request, model_engine

SLOTS = 12


def caches(family_model, recall: bool):
    """A 1-row prompt cache and a 3-row batch cache whose rows hold 15 tokens (past their slots)."""
    layers = family_model.config.num_hidden_layers
    if recall:
        from h2ochat.recall.tiered import RecallConfig

        make = lambda: recall_cache(layers, "h2o", SLOTS, recall=RecallConfig(8, 4, "exact", EXACT), max_positions=64)
    else:
        make = lambda: H2OCache(layers, "h2o", SLOTS, max_positions=64)
    return make(), make()


def state(cache: H2OCache) -> list[torch.Tensor]:
    return [tensor for layer in cache.layers for tensor in layer.state_tensors().values()]


@pytest.mark.parametrize("recall", [False, True], ids=["h2o", "recall"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixed_step_equals_the_chunk_and_the_decode_step_run_apart(family, recall):
    model = build_model(family, seed=0)
    generator = torch.Generator().manual_seed(1)
    history = torch.randint(3, VOCAB, (3, 15), generator=generator)
    prompt = torch.randint(3, VOCAB, (1, 11), generator=generator)
    tokens = torch.randint(3, VOCAB, (3,), generator=generator)
    active = torch.tensor([True, False, True])  # the middle row sits the step out
    results = {}
    for form in ("apart", "mixed"):
        prompt_cache, batch = caches(model, recall)
        prefill(model, batch, history, chunk=5)
        prefill(model, prompt_cache, prompt[:, :6], chunk=6)
        if form == "mixed":
            prompt_logits, logits = mixed_forward(model, prompt_cache, prompt[:, 6:], batch, tokens, active)
        else:
            prompt_logits = forward(model, prompt_cache, prompt[:, 6:], logits_to_keep=1)[0, -1]
            logits = forward(model, batch, tokens.view(3, 1), logits_to_keep=1, active=active)[:, -1]
        results[form] = prompt_logits, logits[active], state(prompt_cache), state(batch), batch.tokens_fed.clone()
    apart, mixed = results["apart"], results["mixed"]
    torch.testing.assert_close(mixed[0], apart[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(mixed[1], apart[1], rtol=0, atol=1e-5)
    for ours, theirs in zip(mixed[2] + mixed[3], apart[2] + apart[3]):
        if ours.is_floating_point():
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        else:
            assert torch.equal(ours, theirs)
    assert mixed[4].tolist() == apart[4].tolist() == [16, 15, 16]  # the row left out fed nothing


def served_tokens(model, mixed_steps: bool, seed: int, **cache):
    """Six requests of random prompts joining a 3-row server over time, run to the end: their tokens,
    and how many steps mixed a prompt chunk into the decode step."""
    scheduler, _ = model_engine(model, 3, budget="12", chunk=4, buckets=(3,), mixed_steps=mixed_steps,
                                cache=cache or None)
    runner = scheduler.backend.runner
    mixed_calls = []
    original = runner.mixed
    runner.mixed = lambda *args: mixed_calls.append(1) or original(*args)
    rng = random.Random(seed)
    requests = [make_request([rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 14))],
                             max_tokens=rng.randint(4, 12), stop_ids=()) for _ in range(6)]
    for number, request in enumerate(requests):
        scheduler.submit(request)
        for _ in range(number % 3):  # later requests join rows that are decoding
            scheduler.step()
    drain(scheduler)
    return [generated(request) for request in requests], len(mixed_calls)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_server_that_mixes_steps_serves_the_tokens_of_one_that_does_not(family):
    model = build_model(family, seed=3)
    reference, never = served_tokens(model, mixed_steps=False, seed=5)
    tokens, mixed = served_tokens(model, mixed_steps=True, seed=5)
    assert never == 0 and mixed >= 5
    assert tokens == reference


def test_a_recall_server_that_mixes_steps_serves_the_tokens_of_one_that_does_not():
    model = build_model("llama", seed=3)
    recall = dict(recall="4", page=2, cold_dtype=EXACT)
    reference, _ = served_tokens(model, mixed_steps=False, seed=7, **recall)
    tokens, mixed = served_tokens(model, mixed_steps=True, seed=7, **recall)
    assert mixed >= 5 and tokens == reference


def test_steps_mix_by_default_whether_the_decode_step_is_compiled_or_not(monkeypatch):
    model = build_model("llama", seed=0)
    eager, _ = model_engine(model, 2)
    assert eager.backend.mixes_steps
    compiled, _ = model_engine(model, 2, compile=True)  # (built, not yet traced)
    assert compiled.backend.compiled and compiled.backend.mixes_steps
    told_not, _ = model_engine(model, 2, compile=True, mixed_steps=False)
    assert not told_not.backend.mixes_steps
    # a cache whose steps cannot leave rows out runs every row, free ones on a placeholder: never mixed
    monkeypatch.setattr(H2OCache, "masks_inactive_rows", property(lambda self: False))
    unmasked, _ = model_engine(model, 2)
    assert not unmasked.backend.masks_rows and not unmasked.backend.mixes_steps


# -- the scheduler's side, on the fake backend -------------------------------------------------------
def test_the_last_chunk_of_a_step_is_mixed_into_its_decode_step_and_tokens_stay_the_same(seed):
    rng = random.Random(seed)
    backend = FakeBackend(rows=2, chunk=3)
    backend.mix = True
    scheduler = Scheduler(backend)
    requests = [make_request([rng.randrange(4, 40) for _ in range(rng.randint(1, 12))], max_tokens=rng.randint(2, 9))
                for _ in range(5)]
    for request in requests:
        scheduler.submit(request)
    drain(scheduler)
    for request in requests:
        assert generated(request) == [greedy_alone(request.prompt_ids, request.prepared.max_tokens)]
    kinds = [entry[0] for entry in backend.log]
    assert "mixed" in kinds
    # a mixed step reads one chunk and decodes: never a chunk alone while rows were decoding before it
    for index, kind in enumerate(kinds):
        if kind == "mixed":
            assert kinds[index - 2:index] == ["prefill", "decode"]


def test_a_failing_mixed_step_fails_the_request_being_read_and_the_batch():
    backend = FakeBackend(rows=2, chunk=2)
    backend.mix = True
    scheduler = Scheduler(backend)
    running = make_request([4, 5], max_tokens=10)
    scheduler.submit(running)
    scheduler.step()  # read alone (no row was decoding): installed
    reading = make_request([6, 7, 8, 9, 10], max_tokens=3)
    scheduler.submit(reading)
    backend.fail_prefill = True
    scheduler.step()
    backend.fail_prefill = False
    assert running.events[-1][0] == "error" and reading.events[-1][0] == "error"
    assert scheduler.rows == [None, None] and scheduler.job is None and backend.aborted
    after = make_request([7, 8], max_tokens=4)
    scheduler.submit(after)
    drain(scheduler)
    assert generated(after) == [greedy_alone([7, 8], 4)]
