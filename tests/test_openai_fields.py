"""The server's OpenAI request fields: docs/openai-fields.md's table, row by row, against the
application (a fake model behind the real request checks and the real ``Preparer``), and what the
supported sampling fields do to the tokens drawn (``serve.sampling.sample_rows``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from h2ochat.serve.app import build_app
from h2ochat.serve.engine import Loaded
from h2ochat.serve.parked import ParkedStore
from h2ochat.serve.prepare import Preparer
from h2ochat.serve.sampling import sample_rows

from serve_fakes import VOCAB, FakeBackend, FakeTokenizer, greedy_alone, make_request, next_token
from test_serve_app import call, make_engine, wait

TABLE = Path(__file__).resolve().parents[1] / "docs" / "openai-fields.md"
BASE = {"chat": {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        "completions": {"model": "fake", "prompt": "hi", "max_tokens": 3}}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# the param a refusal names, where the OpenAI API names another field than the one sent
NAMED_AS = {"top_logprobs": "logprobs", "functions": "tools"}


class ChatTokenizer(FakeTokenizer):
    """Text is its bytes (ids 4 + byte % 30: below the fake vocabulary); a chat template of sorts."""

    chat_template = "fake"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    def __call__(self, text, add_special_tokens=True):
        class Encoded:
            input_ids = [4 + byte % 30 for byte in text.encode()]
        return Encoded()


def table_rows() -> list[tuple[str, str, str, object]]:
    rows = []
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[2] in ("supported", "ignored", "refused"):
            rows.append((cells[0], cells[1], cells[2], json.loads(cells[3].strip("`"))))
    return rows


@pytest.fixture(scope="module")
def app():
    tokenizer = ChatTokenizer()
    backend = FakeBackend(rows=2)
    preparer = Preparer(tokenizer, ParkedStore(0), vocab_size=VOCAB, max_context=10_000, bounded=False,
                        max_tokens_cap=8, max_prompt_tokens=64)
    engine = make_engine(lambda: Loaded(backend, tokenizer, preparer, frozenset({3}), "fake"))
    engine.start()
    wait(lambda: engine.ready)
    yield build_app(engine)
    engine.stop()


def test_the_table_lists_every_field_the_request_bodies_name():
    from h2ochat.serve.api import ChatBody, CompletionBody

    listed = {row[0] for row in table_rows()}
    named = set(ChatBody.model_fields) | set(CompletionBody.model_fields)
    assert named <= listed, f"fields the server reads but the table does not list: {sorted(named - listed)}"
    assert len(table_rows()) >= 40


@pytest.mark.parametrize("field, endpoint, verdict, example", table_rows(),
                         ids=[f"{r[0]}={json.dumps(r[3])[:20]}" for r in table_rows()])
def test_every_listed_field_gets_the_tables_verdict(app, field, endpoint, verdict, example):
    for kind in (("chat", "completions") if endpoint == "both" else (endpoint,)):
        body = dict(BASE[kind], **{field: example})
        if field == "stream":  # (the ASGI helper reads a whole body: the stream is read whole too)
            pass
        status, _, raw = call(app, "POST", PATHS[kind], body)
        if verdict == "refused":
            assert status == 400, (kind, raw)
            error = json.loads(raw)["error"]
            assert error["param"] == NAMED_AS.get(field, field), error
            assert NAMED_AS.get(field, field) in error["message"] or field in error["message"], error
        else:
            assert status == 200, (kind, raw)


def test_a_bad_logit_bias_is_a_400_naming_it(app):
    for bias in ({"x": 1}, {"5": 101}, {"999": 1}, [1, 2]):
        status, _, raw = call(app, "POST", "/v1/completions", dict(BASE["completions"], logit_bias=bias))
        assert status == 400 and json.loads(raw)["error"]["param"] == "logit_bias", (bias, raw)


def test_penalties_out_of_range_are_a_400(app):
    for field in ("frequency_penalty", "presence_penalty"):
        status, _, raw = call(app, "POST", "/v1/completions", dict(BASE["completions"], **{field: 2.5}))
        assert status == 400 and json.loads(raw)["error"]["param"] == field


def test_a_deeply_nested_body_is_a_400_not_valid_json(app):
    raw_body = b"[" * 100_000 + b"]" * 100_000

    import asyncio

    async def run():
        sent = []

        async def receive():
            return {"type": "http.request", "body": raw_body, "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "root_path": "", "headers": [], "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    status, body = asyncio.run(run())
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]


def test_a_prompt_over_max_prompt_tokens_is_a_400_before_the_engine_sees_it(app):
    status, _, raw = call(app, "POST", "/v1/completions", dict(BASE["completions"], prompt="x" * 65))
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded" and "--max-prompt-tokens" in error["message"]
    status, _, raw = call(app, "POST", "/v1/completions", dict(BASE["completions"], prompt="x" * 64))
    assert status == 200


# -- what the sampling fields do ------------------------------------------------------------------
def _greedy(prompt, tokens, **params):
    request = make_request(prompt, max_tokens=tokens)
    for name, value in params.items():
        setattr(request.prepared.params, name, value)
    choice = request.choices[0]
    history = list(prompt)
    for _ in range(tokens):
        logits = torch.zeros(1, VOCAB)
        logits[0, next_token(history)] = 10.0
        logits[0, 20] = 9.0  # the runner-up, everywhere
        [token] = sample_rows(logits, [choice])
        choice.generated.append(token)
        history.append(token)
    return choice.generated


def test_logit_bias_bans_and_forces_a_token():
    prompt = [5, 6, 7]
    plain = _greedy(prompt, 6)
    assert plain == greedy_alone(prompt, 6) or plain[0] == next_token(prompt)
    banned = _greedy(prompt, 1, logit_bias={plain[0]: -100.0})
    assert banned == [20]  # the runner-up
    assert _greedy(prompt, 4, logit_bias={11: 100.0}) == [11, 11, 11, 11]


def test_frequency_and_presence_penalties_act_on_generated_tokens_only():
    prompt = [5, 6, 7]
    # forced to 11 by +10.5 over its 0 logit: beats the best (10) until a penalty of > 0.5 applies
    forced = {11: 10.5}
    assert _greedy(prompt, 3, logit_bias=forced) == [11, 11, 11]
    # presence 1.0: once 11 was generated it drops to 9.5, under the best token's 10
    second = _greedy(prompt, 2, logit_bias=forced, presence_penalty=1.0)
    assert second[0] == 11 and second[1] != 11
    # frequency 0.3: 10.2 after one, 9.9 after two: 11, 11, then another
    freq = _greedy(prompt, 3, logit_bias=forced, frequency_penalty=0.3)
    assert freq[:2] == [11, 11] and freq[2] != 11
    # a token only in the prompt is not penalised: the prompt's 5 forced the same way is drawn first
    assert _greedy(prompt, 1, logit_bias={5: 10.5}, presence_penalty=2.0) == [5]


def test_a_row_with_offsets_leaves_its_neighbours_logits_as_they_were():
    biased = make_request([5, 6, 7], max_tokens=2)
    biased.prepared.params.logit_bias = {8: 100.0}
    plain = make_request([5, 6, 7], max_tokens=2)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    tokens = sample_rows(logits, [biased.choices[0], plain.choices[0]])
    assert tokens[0] == 8 and tokens[1] == int(before[1].argmax())
    assert torch.equal(logits, before)
