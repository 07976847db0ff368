"""The serve engine on real tiny models (OPT, Llama-GQA, GPT-NeoX), without HTTP: the scheduler over
``ModelBackend``'s batch cache. A request's tokens do not depend on what else runs in the batch, on
when it joined, or on whether its conversation was parked and resumed; the compiled decode step
gives the eager tokens; the full policy reserves its slots and the preparer refuses what exceeds them.

References run through the same N-row batch (every row's numbers are bitwise the same whatever the
other rows hold), so token comparisons cannot turn on a floating-point near-tie: the tests that
compare a request in a batch with itself alone run every step on all N rows (``buckets=(ROWS,)``;
a step of fewer rows rounds the last bit differently). test_serve_rows.py tests the buckets."""

from __future__ import annotations

import random

import pytest
import torch
from torch._dynamo.utils import counters

from h2ochat.engine import compiled
from h2ochat.engine.generation import CacheSettings
from h2ochat.serve.api import RequestParams
from h2ochat.serve.errors import APIError
from h2ochat.serve.parked import ParkedStore
from h2ochat.serve.prepare import Preparer

from conftest import VOCAB, build_model
from serve_fakes import drain as drain_until_idle, generated, make_request, model_engine

ROWS, CHUNK = 3, 5


def drain(scheduler) -> None:
    drain_until_idle(scheduler, limit=2000)


def engine(model, policy="h2o", budget="12", store=None, **kwargs):
    return model_engine(model, ROWS, policy=policy, budget=budget, store=store, chunk=CHUNK, **kwargs)


def prompts(rng, count):
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 23))] for _ in range(count)]


def served(scheduler, seed, count, max_tokens):
    """The tokens of ``count`` requests (``prompts`` from ``seed``) submitted at once and run to the end."""
    requests = [make_request(prompt, max_tokens=max_tokens, stop_ids=()) for prompt in prompts(random.Random(seed), count)]
    for request in requests:
        scheduler.submit(request)
    drain(scheduler)
    return [generated(request) for request in requests]


def alone(model, prompt, max_tokens, **kwargs):
    scheduler, _ = engine(model, **kwargs)
    request = make_request(prompt, max_tokens=max_tokens, stop_ids=())
    scheduler.submit(request)
    drain(scheduler)
    return generated(request)[0]


@pytest.mark.parametrize("policy, budget", [("h2o", "12"), ("mean", "12"), ("full", "60")])
def test_tokens_do_not_depend_on_the_batch_or_when_a_request_joins(family, policy, budget, seed):
    rng = random.Random(seed)
    model = build_model(family)
    scheduler, _ = engine(model, policy, budget, buckets=(ROWS,))
    requests = [make_request(prompt, max_tokens=rng.randint(1, 20), stop_ids=()) for prompt in prompts(rng, 6)]
    # two at once, the others joining while they run
    for request in requests[:2]:
        scheduler.submit(request)
    for request in requests[2:]:
        for _ in range(rng.randint(0, 6)):
            scheduler.step()
        scheduler.submit(request)
    drain(scheduler)
    for request in requests:
        expected = alone(model, request.prompt_ids, request.prepared.max_tokens, policy=policy, budget=budget,
                         buckets=(ROWS,))
        assert generated(request) == [expected]


def test_a_resumed_conversation_reads_only_its_new_tokens(family, seed):
    """Turn 2 resumes the cache turn 1 parked (its prompt and reply but the reply's last token, which
    turn 2 feeds first); the REPL comparison of the replies is in test_serve.py."""
    rng = random.Random(seed)
    model = build_model(family)
    scheduler, store = engine(model)
    first = make_request(prompts(rng, 1)[0], max_tokens=7, stop_ids=())
    scheduler.submit(first)
    drain(scheduler)
    assert len(store) == 1
    follow = first.prompt_ids + generated(first)[0] + prompts(rng, 1)[0]
    second = make_request(follow, max_tokens=9, stop_ids=())
    scheduler.submit(second)
    drain(scheduler)
    fed_before = len(first.prompt_ids) + 7 - 1
    assert second.cached_tokens == fed_before and second.fed_ids == follow[fed_before:]
    assert len(generated(second)[0]) == 9 and len(store) == 1  # taken, then parked again, longer
    unrelated = make_request(prompts(rng, 1)[0] + [1], max_tokens=2, stop_ids=())
    scheduler.submit(unrelated)
    drain(scheduler)
    assert unrelated.cached_tokens == 0 and len(store) == 2


def test_the_compiled_step_gives_the_eager_tokens(monkeypatch, seed):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    rng = random.Random(seed)
    model = build_model("llama")
    eager, _ = engine(model)
    fast, _ = engine(model, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    fast.backend.warm_up()  # (the server compiles while loading): dummy tokens in every row, then all reset
    # one graph for one row and one for every larger bucket (the batch turns dynamic at its second size)
    assert len(fast.backend.buckets) >= 3 and counters["stats"]["unique_graphs"] - graphs == 2
    assert served(fast, seed, count=4, max_tokens=12) == served(eager, seed, count=4, max_tokens=12)
    assert counters["stats"]["unique_graphs"] - graphs == 2  # the requests' steps compiled nothing more
    assert fast.backend.decode_step is not None and fast.backend.cache.static_shapes


def test_a_compiled_recall_server_builds_its_step_before_any_request_and_gives_the_eager_tokens(monkeypatch, seed):
    """``serve --recall --compile``: the warm-up builds the step on a cache no request has touched (its
    recall tier's last queries are made by an eager step first: without it the trace failed on
    ``None.copy_`` and the server fell back to eager decoding), the requests compile nothing more, and
    the tokens are those of the same server decoding eagerly (its fallback: the static-shape cache, whose
    pages are chosen before each step with the last step's queries; the default eager server chooses
    inside the step with its own, so its tokens may differ). A query group of 2 (4 heads over 2 KV
    heads), int8 slots, as the failing SmolLM2 server had (9 over 3)."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    model = build_model("llama", num_key_value_heads=2)
    cache = {"recall": "4", "page": 2, "kv_dtype": "int8"}
    eager, _ = engine(model, compile=True, cache=cache)
    eager.backend.runner.decode_eagerly()
    fast, _ = engine(model, compile=True, cache=cache)
    assert fast.backend.compiled_warm_up() is None  # (a failure returns its reason and decodes eagerly)
    graphs = counters["stats"]["unique_graphs"]
    assert served(fast, seed, count=3, max_tokens=10) == served(eager, seed, count=3, max_tokens=10)
    assert fast.backend.decode_step is not None and counters["stats"]["unique_graphs"] == graphs


def test_a_server_compiles_its_step_by_default_where_the_step_covers_its_rows(monkeypatch):
    """``compile=None`` (the CLI's default): compiled for an evicting policy over bucket views and for a
    recall tier on the CPU (its graph chooses a step's pages inside the step, as the eager step does:
    ``recall.graph_choice``; not on a GPU, whose graph would choose them before it); eager for the full
    policy (its slots grow) and a policy that ranks on the host (random)."""
    from h2ochat.serve.backend import compiles_by_default

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    model = build_model("llama")
    recall_cache = CacheSettings(policy="h2o", budget="12", recall="4", page=2).build(model)
    assert compiles_by_default(recall_cache, "cpu") and not compiles_by_default(recall_cache, "cuda")
    expected = {("h2o", None): True, ("tova", None): True, ("h2o", "4"): True, ("full", None): False,
                ("random", None): False}
    for (policy, recall), compiles in expected.items():
        settings = CacheSettings(policy=policy, budget="12", recall=recall, page=2)
        assert compiles_by_default(settings.build(model)) is compiles, (policy, recall)
        scheduler, _ = engine(model, policy=policy, compile=None, cache={"recall": recall, "page": 2})
        assert scheduler.backend.compiled is compiles, (policy, recall)
    assert engine(model, compile=False)[0].backend.compiled is False


def test_a_compile_that_fails_leaves_the_server_decoding_eagerly(monkeypatch, seed):
    """A backend that cannot compile (inductor without a C++ compiler): the warm-up says why in one line
    and every later step runs eagerly, giving the eager server's tokens."""
    def no_compiler(graph, example_inputs):
        raise RuntimeError("no C++ compiler found\n(the rest of a long report)")

    monkeypatch.setattr(compiled, "BACKEND", no_compiler)
    torch._dynamo.reset()
    model = build_model("llama")
    failing, _ = engine(model, compile=True)
    assert failing.backend.compiled
    reason = failing.backend.compiled_warm_up()
    assert reason is not None and "no C++ compiler found" in reason and "\n" not in reason
    assert not failing.backend.compiled
    eager, _ = engine(model)
    runs = []
    for scheduler in (eager, failing):
        requests = [make_request(prompt, max_tokens=6, stop_ids=()) for prompt in prompts(random.Random(seed), 3)]
        for request in requests:
            scheduler.submit(request)
        drain(scheduler)
        runs.append([generated(request) for request in requests])
    assert runs[0] == runs[1]
    torch._dynamo.reset()


def test_the_preparer_holds_requests_to_the_context(tmp_path):
    from checkpoints import _tokenizer

    tokenizer = _tokenizer(vocab_size=300)
    store = ParkedStore(1 << 20)

    def prepare(bounded, max_tokens=None, text="once upon a time"):
        preparer = Preparer(tokenizer, store, vocab_size=len(tokenizer), max_context=40, bounded=bounded,
                            max_tokens_cap=100)
        return preparer(RequestParams(kind="chat", model="m", messages=[{"role": "user", "content": text}],
                                      max_tokens=max_tokens))

    prompt = len(prepare(False).prompt_ids)
    assert prompt < 40
    assert prepare(False).max_tokens == 100 and prepare(True).max_tokens == 40 - prompt
    for bounded, max_tokens, text in ((True, 41 - prompt, "once upon a time"), (True, None, "dragon " * 30)):
        with pytest.raises(APIError) as caught:
            prepare(bounded, max_tokens, text)
        assert caught.value.status == 400 and caught.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as caught:
        prepare(False, 101)
    assert caught.value.param == "max_tokens"


def test_the_full_policy_serves_any_number_of_steps_in_its_reserved_slots(seed):
    """Each row reserves --budget slots; many requests one after another (more decode steps in all
    than the slots) neither grow the batch nor fail a request."""
    rng = random.Random(seed)
    scheduler, _ = engine(build_model("llama"), "full", "20")
    requests = [make_request([rng.randrange(3, VOCAB) for _ in range(6)], max_tokens=12, stop_ids=())
                for _ in range(8)]
    for request in requests:
        scheduler.submit(request)
    drain(scheduler)
    assert all(request.events[-1][0] == "done" for request in requests)
    assert {layer.capacity for layer in scheduler.backend.cache.layers} == {20}
    assert scheduler.backend.cache.evicted_tokens() == 0


def test_the_full_policy_is_served_as_the_full_cache(family, seed):
    """The server's full-policy rows are full-policy caches that keep their columns (a bound the
    preparer holds them to), and a request's tokens are those of the growing full cache alone."""
    from h2ochat.engine.generation import CacheSettings, forward, prefill

    rng = random.Random(seed)
    model = build_model(family)
    scheduler, _ = model_engine(model, 1, policy="full", budget="40", chunk=CHUNK)
    prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 15))]
    request = make_request(prompt, max_tokens=20, stop_ids=())
    scheduler.submit(request)
    drain(scheduler)
    cache = scheduler.backend.cache
    assert cache.policy.name == "full" and not cache.grows and cache.evicted_tokens() == 0
    assert {layer.capacity for layer in cache.layers} == {40}
    reference = CacheSettings(policy="full", budget="4").build(model)  # grows from 4 slots
    assert reference.grows
    with torch.inference_mode():
        logits = prefill(model, reference, torch.tensor([prompt]), chunk=CHUNK)
        expected = [int(logits.argmax(-1))]
        for _ in range(19):
            logits = forward(model, reference, torch.tensor([[expected[-1]]]), logits_to_keep=1)[:, -1]
            expected.append(int(logits.argmax(-1)))
    assert generated(request) == [expected]
