"""Several prompt chunks per engine step (``Scheduler(prefill_chunks=k)``, `serve
--prefill-chunks-per-step`): a step reads up to k chunks, of one request or of the next ones waiting
when one is read and the next fits the free rows, then runs one decode step. The tokens are those of
one chunk per step (fake model, and the real backend on the three tiny families bit for bit), a
request whose prompt fails leaves the others of the step alone, and k = 1 is the one-chunk schedule."""

from __future__ import annotations

import random

import pytest

from h2ochat.serve.scheduler import Scheduler

from conftest import VOCAB, build_model
from serve_fakes import FakeBackend, drain, generated, greedy_alone, make_request, model_engine


def prompts(rng, count, low=1, high=30):
    return [[rng.randrange(4, 40) for _ in range(rng.randint(low, high))] for _ in range(count)]


def test_a_step_reads_up_to_k_chunks_across_requests_then_decodes(seed):
    rng = random.Random(seed)
    backend = FakeBackend(rows=4, chunk=4)
    scheduler = Scheduler(backend, prefill_chunks=3)
    requests = [make_request(prompt, max_tokens=rng.randint(1, 8)) for prompt in prompts(rng, 7)]
    for request in requests:
        scheduler.submit(request)
    while not scheduler.idle:
        before = len(backend.log)
        scheduler.step()
        step = backend.log[before:]
        kinds = [entry[0] for entry in step if entry[0] in ("prefill", "decode")]
        assert kinds.count("prefill") <= 3 and kinds.count("decode") <= 1
        assert "prefill" not in kinds[kinds.index("decode"):] if "decode" in kinds else True  # prompts first
    for request in requests:
        assert generated(request) == [greedy_alone(request.prompt_ids, request.prepared.max_tokens)]
    # chunks of different requests shared a step: the next one was admitted when the first was read
    assert len({entry[1] for entry in backend.log if entry[0] == "prefill"}) == len(requests)


def test_one_chunk_per_step_is_the_default_schedule(seed):
    logs = []
    for chunks in (None, 1):
        backend = FakeBackend(rows=3, chunk=4)
        scheduler = Scheduler(backend) if chunks is None else Scheduler(backend, prefill_chunks=chunks)
        for prompt in prompts(random.Random(seed), 5):
            scheduler.submit(make_request(prompt, max_tokens=5))
        while not scheduler.idle:
            scheduler.step()
        logs.append([entry[0] if entry[0] != "prefill" else entry[::2] for entry in backend.log])
    assert logs[0] == logs[1]
    with pytest.raises(ValueError):
        Scheduler(FakeBackend(rows=1), prefill_chunks=0)


class OneBadPrompt(FakeBackend):
    """The prompt whose first token is ``bad`` fails when its second chunk is read."""

    def __init__(self, *args, bad: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.bad = bad

    def prefill(self, job):
        if job.request.prompt_ids[0] == self.bad and job.fed > 0:
            raise RuntimeError("this prompt broke")
        return super().prefill(job)


def test_a_prompt_that_fails_mid_step_fails_alone(seed):
    rng = random.Random(seed)
    backend = OneBadPrompt(rows=3, chunk=4, bad=3)
    scheduler = Scheduler(backend, prefill_chunks=4)
    bad = make_request([3] + [rng.randrange(4, 40) for _ in range(9)], max_tokens=4)
    good = [make_request(prompt, max_tokens=6) for prompt in prompts(rng, 4, 2, 14)]
    scheduler.submit(good[0])
    scheduler.submit(bad)
    for request in good[1:]:
        scheduler.submit(request)
    while not scheduler.idle:
        scheduler.step()
    assert bad.events[-1][0] == "error" and backend.aborted
    for request in good:
        assert request.events[-1][0] == "done"
        assert generated(request) == [greedy_alone(request.prompt_ids, 6)]


@pytest.mark.parametrize("cache", [None, {"recall": "8", "page": 4}])
def test_several_chunks_per_step_give_the_tokens_of_one_chunk_per_step(family, cache, seed):
    """The real backend (all rows every step: bitwise the same numbers whatever the schedule): only
    when each request joins the batch changes. With a recall tier the rows share one staging-page
    flush, which an import brings forward (``RecallTier._fold_staged``): a request's tokens may then
    depend on when the others joined, so there every request is served, and only alone it is exact."""
    rng = random.Random(seed)
    model = build_model(family)
    plan = [([rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 40))], rng.randint(2, 14)) for _ in range(6)]
    runs = []
    for chunks in (1, 3):
        scheduler, _ = model_engine(model, 3, budget="16", chunk=5, buckets=(3,), cache=cache)
        scheduler = Scheduler(scheduler.backend, prefill_chunks=chunks)
        requests = [make_request(ids, max_tokens=tokens, stop_ids=()) for ids, tokens in plan]
        for request in requests:
            scheduler.submit(request)
        drain(scheduler)
        assert all(request.events[-1][0] == "done" for request in requests)
        runs.append([generated(request) for request in requests])
    if cache is None:
        assert runs[0] == runs[1]
