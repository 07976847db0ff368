"""`h2ochat serve` as a client sees it: a live server process on a loopback port with a tiny model,
driven by the `openai` package (and raw HTTP where the client would hide what is checked).

Comparisons of generated text are greedy on a checkpoint whose non-text tokens can never win
(serve_harness.clean_checkpoint), and compare runs through the same N-row batch (bitwise the same
numbers whatever the other rows hold), except the REPL comparison, whose 1-row cache rounds the
last bit differently (1e-7 on logits some 0.1 apart).
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading

import httpx2 as httpx
import openai
import pytest

from h2ochat.chat.conversation import ChatSettings, Conversation
from h2ochat.config import Sampling
from h2ochat.engine.generation import CacheSettings
from h2ochat.loading.models import load

from seeds import fresh
from serve_fakes import chat_beside_the_repl, words
from serve_harness import clean_checkpoint, fresh_checkpoint, running

BUDGET, ROWS, QUEUE, LAYERS, KV_HEADS, CHUNK = 16, 4, 8, 2, 2, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return fresh_checkpoint(tmp_path_factory, "serve-model")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    with running(checkpoint, "--budget", str(BUDGET), "--policy", "h2o", "--max-sequences", str(ROWS),
                 "--max-queue", str(QUEUE), "--prefill-chunk", str(CHUNK), "--parked-bytes", "320KiB",
                 log_dir=tmp_path_factory.mktemp("serve-log")) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="anything", max_retries=0, timeout=120)


def ask(client, server, content: str, **kwargs):
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}],
                                          **kwargs)


def streamed_chat(client, server, content: str, **kwargs):
    """(text per choice, finish reasons per choice, chunks) of a streamed chat request."""
    kwargs.setdefault("temperature", 0)
    chunks = list(client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}],
                                                 stream=True, **kwargs))
    texts, reasons = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, reasons, chunks


IGNORE_EOS = {"ignore_eos": True}


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [model.id for model in client.models.list().data] == [server.model]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_streamed_text_equals_the_whole_text_at_temperature_0(server, client, seed):
    rng = random.Random(seed)
    prompt = words(rng, 8)
    whole = ask(client, server, prompt, max_tokens=24)
    texts, reasons, chunks = streamed_chat(client, server, prompt, max_tokens=24,
                                           stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts[0] == whole.choices[0].message.content
    assert reasons == {0: [whole.choices[0].finish_reason]}  # exactly one chunk carries it
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # the text completions endpoint, the same way
    text_prompt = words(rng, 6)
    plain = client.completions.create(model=server.model, prompt=text_prompt, max_tokens=20, temperature=0)
    pieces = list(client.completions.create(model=server.model, prompt=text_prompt, max_tokens=20, temperature=0,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == plain.choices[0].text
    assert [p.choices[0].finish_reason for p in pieces if p.choices and p.choices[0].finish_reason] == [
        plain.choices[0].finish_reason]


def test_the_raw_stream_ends_with_done(server, seed):
    body = {"model": server.model, "messages": [{"role": "user", "content": words(random.Random(seed), 4)}],
            "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in events)


def test_usage_adds_up_and_says_what_the_cache_did(server, client, seed):
    rng = random.Random(seed)
    reply = ask(client, server, words(rng, 10), max_tokens=30, extra_body=IGNORE_EOS)
    usage = reply.usage
    assert usage.completion_tokens == 30 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    fed = usage.prompt_tokens + usage.completion_tokens - 1  # the last token is never fed
    assert usage.model_extra["kv_slots"] == BUDGET
    assert usage.model_extra["evicted_tokens"] == LAYERS * KV_HEADS * max(0, fed - BUDGET)


def test_n_choices_carry_their_index_and_choice_0_is_the_single_request(server, client, seed):
    rng = random.Random(seed)
    prompt, sampled_seed = words(rng, 6), rng.randrange(1000)
    three = ask(client, server, prompt, n=3, temperature=0.9, seed=sampled_seed, max_tokens=12, extra_body=IGNORE_EOS)
    assert [choice.index for choice in three.choices] == [0, 1, 2]
    assert three.usage.completion_tokens == 36
    one = ask(client, server, prompt, temperature=0.9, seed=sampled_seed, max_tokens=12, extra_body=IGNORE_EOS)
    assert one.choices[0].message.content == three.choices[0].message.content
    texts, reasons, _ = streamed_chat(client, server, prompt, n=3, temperature=0.9, seed=sampled_seed,
                                      max_tokens=12, extra_body=IGNORE_EOS)
    assert reasons == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert [texts[i] for i in range(3)] == [choice.message.content for choice in three.choices]


def test_stop_strings_cut_the_text(server, client, seed):
    rng = random.Random(seed)
    prompt = words(rng, 7)
    base = ask(client, server, prompt, max_tokens=30, extra_body=IGNORE_EOS).choices[0].message.content
    assert len(base) >= 12, base
    stop = base[6:9]
    cut = base.find(stop)
    stopped = ask(client, server, prompt, max_tokens=30, stop=[stop, "never appears \u2603"], extra_body=IGNORE_EOS)
    assert stopped.choices[0].message.content == base[:cut] and stopped.choices[0].finish_reason == "stop"
    texts, reasons, _ = streamed_chat(client, server, prompt, max_tokens=30, stop=stop, extra_body=IGNORE_EOS)
    assert texts[0] == base[:cut] and reasons == {0: ["stop"]}


def test_a_seed_reproduces_a_sampled_reply(server, client, seed):
    rng = random.Random(seed)
    prompt = words(rng, 6)

    def sampled(value):
        return ask(client, server, prompt, temperature=1.0, seed=value, max_tokens=20,
                   extra_body=IGNORE_EOS).choices[0].message.content

    first = sampled(1234)
    assert sampled(1234) == first
    assert any(sampled(value) != first for value in (1, 2, 3))


def test_a_chat_turn_after_turn_reuses_its_parked_cache_and_equals_the_repl(server, client, checkpoint, seed):
    """A resumed conversation is the REPL's: the same replies as `h2ochat run` with the same cache
    settings, each turn reading only its new tokens from the cache the last one left."""
    rng = random.Random(seed)
    loaded = load(str(checkpoint), "cpu", "float32")
    repl = Conversation(loaded.model, loaded.tokenizer, ChatSettings(
        sampling=Sampling(temperature=0.0), max_new_tokens=12, cache=CacheSettings(policy="h2o", budget=str(BUDGET))), prefill_chunk=CHUNK)
    previous = None
    for turn, reply, expected in chat_beside_the_repl(client, server.model, repl, rng):
        content = reply.choices[0].message.content
        assert content == expected.text == repl.messages[-1]["content"], f"turn {turn + 1}"
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if previous is None:
            assert cached == 0
        else:  # everything the last turn fed: its prompt and its reply but the reply's last token
            assert cached == previous.prompt_tokens + previous.completion_tokens - 1, f"turn {turn + 1}"
        assert reply.usage.prompt_tokens == len(repl.ids) + len(repl.pending) - reply.usage.completion_tokens + (
            1 if reply.choices[0].finish_reason == "stop" else 0)
        previous = reply.usage
    assert previous.prompt_tokens > 3 * BUDGET  # the history is several times the budget


def test_2n_concurrent_streams_are_served_or_refused_and_equal_each_alone(server, seed):
    rng = random.Random(seed)
    prompts = [words(rng, rng.randint(3, 12)) for _ in range(2 * ROWS)]

    async def streams():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as aclient:
            async def one(prompt):
                try:
                    stream = await aclient.chat.completions.create(
                        model=server.model, messages=[{"role": "user", "content": prompt}], temperature=0,
                        max_tokens=16, stream=True, extra_body=IGNORE_EOS)
                except openai.RateLimitError:
                    return 429, None
                text = ""
                async for chunk in stream:
                    text += "".join(c.delta.content or "" for c in chunk.choices)
                return 200, text

            return await asyncio.gather(*(one(prompt) for prompt in prompts))

    results = asyncio.run(streams())
    assert all(status in (200, 429) for status, _ in results) and any(status == 200 for status, _ in results)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    for prompt, (status, text) in zip(prompts, results):
        if status == 200:
            alone = ask(client, server, prompt, max_tokens=16, extra_body=IGNORE_EOS).choices[0].message.content
            assert text == alone


def test_a_request_joining_mid_batch_does_not_change_the_others(server, client, seed):
    rng = random.Random(seed)
    first, second = words(rng, 5), words(rng, 9)
    # long enough (900 steps) that the second request comes and goes while it runs, even on a busy machine
    alone = ask(client, server, first, max_tokens=900, extra_body=IGNORE_EOS).choices[0].message.content
    stream = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": first}],
                                            temperature=0, max_tokens=900, stream=True, extra_body=IGNORE_EOS)
    chunks = iter(stream)
    text = "".join(next(chunks).choices[0].delta.content or "" for _ in range(5))
    joined = ask(client, server, second, max_tokens=8, extra_body=IGNORE_EOS)
    # (the gauges are refreshed after each engine step: the one that finished ``joined`` may not be seen yet)
    running = server.wait_metrics(lambda v: v["requests_running"] <= 1, timeout=60)["requests_running"]
    text += "".join(c.choices[0].delta.content or "" for chunk in [None] for c in [])  # (nothing yet)
    for chunk in chunks:
        text += "".join(c.delta.content or "" for c in chunk.choices)
    assert joined.usage.completion_tokens == 8
    assert running == 1  # the second request came and went while the first was still generating
    assert text == alone


def test_closing_a_stream_frees_its_row(server, client, seed):
    before = server.metrics()
    stream = ask(client, server, words(random.Random(seed), 5), max_tokens=4000, stream=True, extra_body=IGNORE_EOS)
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()
    cancelled = 'requests_finished_total{reason="cancelled"}'
    after = server.wait_metrics(lambda v: v["rows_in_use"] == 0 and v[cancelled] > before[cancelled])
    assert after["rows_in_use"] == 0 and after["requests_running"] == 0
    assert after[cancelled] == before[cancelled] + 1


def test_random_disconnects_leak_no_row_and_no_parked_cache(server, client, seed):
    rng = random.Random(seed)
    refused = []

    async def one(http, gate, number):
        body = {"model": server.model, "messages": [{"role": "user", "content": words(rng, rng.randint(1, 10))}],
                "temperature": rng.choice([0, 0.8]), "max_tokens": rng.choice([1, 4, 30, 4000]), "stream": True,
                "ignore_eos": rng.random() < 0.7, "n": rng.choice([1, 1, 2])}
        reads = rng.randint(0, 6)
        async with gate:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code == 429:
                    refused.append(number)
                    return
                assert response.status_code == 200
                seen = 0
                async for line in response.aiter_lines():
                    seen += bool(line)
                    if seen >= reads:
                        break  # leaving the block closes the connection mid-stream

    async def storm():
        gate = asyncio.Semaphore(6)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            await asyncio.gather(*(one(http, gate, number) for number in range(200)))

    asyncio.run(storm())
    values = server.wait_metrics(lambda v: v["rows_in_use"] == 0 and v["requests_waiting"] == 0)
    assert values["rows_in_use"] == 0 and values["requests_running"] == 0 and values["requests_waiting"] == 0
    assert values["kv_slots_in_use"] == 0 and values["kv_bytes_in_use"] == 0
    assert values['requests_finished_total{reason="error"}'] == 0
    # every parked conversation copied out of its row is one row's state (fixed shapes): the bytes are their
    # count times one; the ones resting in a free row (at most one a row) hold no bytes of their own
    assert 0 < values["parked_bytes"] <= values["parked_bytes_limit"] and 0 < values["parked_in_rows"] <= ROWS
    per_entry = values["kv_bytes_reserved"] / ROWS
    copied_out = values["parked_conversations"] - values["parked_in_rows"]
    assert values["parked_bytes"] == pytest.approx(copied_out * per_entry, rel=0.1)
    assert len(refused) < 200
    assert ask(client, server, "the end", max_tokens=3).usage.completion_tokens >= 1


def post(server, body, raw: bytes | None = None, headers=None):
    if raw is not None:
        return httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=60,
                          headers={"content-type": "application/json", **(headers or {})})
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60, headers=headers)


def assert_error(response, status: int, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def test_bad_input_gets_openai_errors_and_the_server_goes_on(server, client):
    ok = {"model": server.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    cases = [
        (post(server, None, raw=b'{"model": "x", "messages": [}'), 400, None, None),
        (post(server, {**ok, "messages": "hello"}), 400, "messages", None),
        (post(server, {**ok, "max_tokens": "three"}), 400, "max_tokens", None),
        (post(server, {**ok, "temperature": [1]}), 400, "temperature", None),
        (post(server, {**ok, "messages": []}), 400, "messages", None),
        (post(server, {**ok, "max_tokens": 10**12}), 400, "max_tokens", None),
        (post(server, {**ok, "logprobs": True}), 400, "logprobs", None),
        (post(server, None, raw=b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800 hi"}]}'
              % server.model.encode()), 400, "messages[0].content", None),
        (post(server, {**ok, "model": "gpt-4o"}), 404, "model", "model_not_found"),
        (httpx.get(server.url + "/v1/no-such-route"), 404, None, None),
    ]
    for response, status, param, code in cases:
        assert_error(response, status, param, code)
        assert post(server, ok).status_code == 200  # still answering
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=[], max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


# -- a second server: absolute positions, one row, a queue of one, an API key -----------------------

KEY = "sekrit"


STRICT_POSITIONS = 8192  # room for a request that holds the one row for thousands of steps


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    fresh("serve-strict-model")
    checkpoint = clean_checkpoint(tmp_path_factory.mktemp("strict-llama"), max_position_embeddings=STRICT_POSITIONS)
    with running(checkpoint, "--budget", str(BUDGET), "--positions", "absolute", "--max-sequences", "1",
                 "--max-queue", "1", "--max-tokens", "10000", "--api-key", KEY, log_dir=tmp_path_factory.mktemp("strict-log")) as process:
        yield process


def test_an_api_key_is_required_when_set(strict):
    body = {"model": strict.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(post(strict, body), 401, code="invalid_api_key")
    assert_error(post(strict, body, headers={"Authorization": "Bearer wrong"}), 401)
    assert post(strict, body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(strict.url + "/health").status_code == 200  # health and metrics stay open


def test_a_prompt_past_the_position_limit_is_context_length_exceeded(strict, seed):
    rng = random.Random(seed)
    client = openai.OpenAI(base_url=strict.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    long_text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz,.;") for _ in range(12000))  # > 8192 tokens
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, strict, long_text, max_tokens=5)
    assert caught.value.status_code == 400 and caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, strict, "hello there", max_tokens=STRICT_POSITIONS - 4)
    assert caught.value.code == "context_length_exceeded"
    assert ask(client, strict, "hello there", max_tokens=4).usage.completion_tokens >= 1


def test_a_full_queue_is_429_with_retry_after(strict, seed):
    client = openai.OpenAI(base_url=strict.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": strict.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    holder = ask(client, strict, "hold the row", max_tokens=8000, stream=True, extra_body=IGNORE_EOS)
    for chunk in holder:  # the role chunk comes at once; the first text comes from the row
        if chunk.choices and chunk.choices[0].delta.content:
            break
    waiting = {}
    waiter = threading.Thread(target=lambda: waiting.update(response=post(strict, body, headers=auth)))
    waiter.start()
    # (the gauges are refreshed after each engine step: wait for both to be seen)
    values = strict.wait_metrics(lambda v: v["requests_waiting"] == 1 and v["rows_in_use"] == 1, timeout=60)
    assert values["requests_waiting"] == 1 and values["rows_in_use"] == 1
    refused = post(strict, body, headers=auth)
    assert_error(refused, 429, code="rate_limit_exceeded")
    assert int(refused.headers["Retry-After"]) >= 1
    holder.close()  # frees the row: the waiting request goes in
    waiter.join(timeout=60)
    assert waiting["response"].status_code == 200
    assert post(strict, body, headers=auth).status_code == 200


@pytest.mark.parametrize("args, fragment", [
    (["--parked-bytes", "lots"], "--parked-bytes must be a size"),
    (["--model", "no-such-model"], "unknown model"),
    (["--budget", "many"], "--budget must be"),
])
def test_bad_options_are_one_line_before_listening(args, fragment):
    result = subprocess.run([sys.executable, "-m", "h2ochat.cli", "serve", "--port", "1", *args], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("h2ochat: error: ") and fragment in result.stderr
