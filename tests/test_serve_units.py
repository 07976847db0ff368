"""Pieces of the server on their own: request checking, the parked-cache store, a choice's text
(stop strings held back and cut), the Prometheus rendering."""

from __future__ import annotations

import random

import pytest

from h2ochat.serve.api import parse_json, parse_request
from h2ochat.serve.errors import APIError
from h2ochat.serve.metrics import Metrics, parse
from h2ochat.serve.parked import Parked, ParkedStore

from serve_fakes import make_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refused(body, kind="chat", **kwargs) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_request(body, kind, max_n=4, **kwargs)
    assert caught.value.status == 400
    return caught.value


def test_lenient_about_unknown_fields_and_the_newer_names():
    params = parse_request({**CHAT, "max_completion_tokens": 7, "user": "x", "frequency_penalty": 0,
                            "stream_options": {"include_usage": True}, "stream": True, "stop": "END",
                            "messages": [{"role": "developer", "content": [{"type": "text", "text": "be "},
                                                                           {"type": "text", "text": "brief"}]},
                                         {"role": "user", "content": "hi", "name": "ann"}]}, "chat", max_n=4)
    assert params.max_tokens == 7 and params.stream and params.include_usage and params.stop == ["END"]
    assert params.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert params.temperature == 1.0 and params.n == 1 and params.skip_special_tokens  # the OpenAI defaults
    extensions = parse_request({**CHAT, "ignore_eos": True, "skip_special_tokens": False}, "chat", max_n=4)
    assert extensions.ignore_eos and not extensions.skip_special_tokens
    prompt = parse_request({"model": "m", "prompt": ["once"], "max_tokens": 3}, "completion", max_n=4)
    assert prompt.prompt == "once"
    assert parse_request({"model": "m", "prompt": [5, 6]}, "completion", max_n=4).prompt == [5, 6]


@pytest.mark.parametrize("change, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"model": 5}, "model"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 5}, "n"),
    ({"n": True}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": True}, "logprobs"),
    ({"seed": 1.5}, "seed"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
])
def test_bad_fields_are_400_naming_the_field(change, param):
    assert refused({**CHAT, **change}).param == param


@pytest.mark.parametrize("change, kind, param", [
    ({"messages": [{"role": "user", "content": "\ud800 hi"}]}, "chat", "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "a \udfff"}]}]}, "chat", "messages[1].content[1].text"),
    ({"prompt": "once \ud83d upon"}, "completion", "prompt"),
    ({"stop": ["fine", "\udc00"]}, "chat", "stop"),
])
def test_a_lone_surrogate_is_400_naming_where_it_is(change, kind, param):
    """JSON can spell half a UTF-16 pair; the tokenizer raised a TypeError on it (a 500)."""
    body = {**CHAT, **change} if kind == "chat" else {"model": "m", **change}
    error = refused(json_round_trip(body), kind)
    assert error.param == param and "surrogate" in error.message


def json_round_trip(body: dict) -> dict:
    """``body`` as the server reads it: sent as JSON text (a surrogate as its \\u escape) and parsed."""
    import json

    raw = json.dumps(body).encode()
    assert b"\\ud" in raw  # (json.dumps escapes it: the bytes themselves are valid UTF-8)
    return parse_json(raw)


def test_malformed_json_is_400():
    with pytest.raises(APIError) as caught:
        parse_json(b"{not json")
    assert caught.value.status == 400 and caught.value.body()["error"]["type"] == "invalid_request_error"
    with pytest.raises(APIError):
        parse_json(b"[1, 2]")
    assert refused({"model": "m", "prompt": ["a", "b"]}, "completion").param == "prompt"


def entry(tokens, fed=None, text=None, nbytes=10):
    return Parked(tuple(tokens), len(tokens) if fed is None else fed, text, object(), nbytes)


def test_parked_store_takes_the_longest_prefix_and_keeps_within_its_bytes(seed):
    rng = random.Random(seed)
    base = [rng.randrange(100) for _ in range(20)]
    store = ParkedStore(capacity=35)
    store.park(entry(base[:5]))
    store.park(entry(base[:12]))
    store.park(entry([999] + base[1:15]))
    assert len(store) == 3 and store.nbytes == 30
    taken = store.take(base + [1, 2])
    assert taken.tokens == tuple(base[:12])  # the longest parked prefix, not the unrelated one
    assert len(store) == 2 and store.take(base[:12]) is not None  # a shorter prefix is still there
    # nothing left to feed is no match: the next token needs fresh logits
    store.park(entry(base[:8]))
    assert store.take(base[:8]) is None
    assert store.take(base[:8] + [0]).tokens == tuple(base[:8])
    # least recently used out first
    store.clear()
    for number in range(4):
        store.park(entry([number]))
    assert len(store) == 3 and store.nbytes == 30 and store.take([0, 5]) is None
    assert not store.park(entry([7], nbytes=36)) and len(store) == 3  # larger than the store: not kept


def test_parked_store_keeps_entries_resting_in_rows_without_bytes_until_they_settle():
    store = ParkedStore(capacity=35)
    resting = Parked((1, 2), 2, None, None, 0, row=3)
    assert store.park(resting) and store.resting == 1 and store.nbytes == 0
    for number in range(5):  # entries with bytes push each other out, never the resting one (it frees nothing)
        store.park(entry([10 + number]))
    assert store.holds(resting) and store.nbytes == 30 and len(store) == 4
    # copied out of its row: counted, room made by dropping the least recently used entry with bytes
    assert store.settle(resting, "state", 10) and resting.row is None and resting.state == "state"
    assert store.nbytes == 30 and store.resting == 0 and store.take([10 + 2, 0]) is None  # (12 was dropped)
    assert store.take([1, 2, 3]) is resting and not store.holds(resting)
    assert not store.settle(resting, "state", 10)  # (taken: nothing to settle)
    larger = Parked((5,), 1, None, None, 0, row=0)
    store.park(larger)
    assert not store.settle(larger, "state", 36) and not store.holds(larger)  # (alone larger than the store)
    assert not ParkedStore(0).park(Parked((1,), 1, None, None, 0, row=0))  # (no parking at all)


def test_parked_store_finds_the_text_a_request_extends():
    store = ParkedStore(capacity=100)
    store.park(entry([1, 2, 3], fed=2, text="<|user|>hi<|assistant|>hello"))
    store.park(entry([1, 2], text="<|user|>hi"))
    found = store.aligned("<|user|>hi<|assistant|>hello<|end|><|user|>more")
    assert found.tokens == (1, 2, 3)
    assert store.aligned("<|user|>bye") is None and len(store) == 2  # looking takes nothing


def texts(request) -> str:
    return "".join(event[2] for event in request.events if event[0] == "text")


def push_all(request, tokens) -> str | None:
    choice = request.choices[0]
    for token in tokens:
        reason = choice.push(token)
        if reason:
            choice.finish(reason)
            return reason
    return None


def test_a_stop_string_is_held_back_until_it_cannot_begin_and_is_cut():
    # token i reads "<i>": "<12><13>" contains the stop string "2><1"
    request = make_request([4], max_tokens=10, stop=["2><1"])
    choice = request.choices[0]
    assert choice.push(11) is None and texts(request) == "<11>"
    assert choice.push(12) is None and texts(request) == "<11><1"  # "2>" may begin the stop string
    assert push_all(request, [13]) == "stop"
    assert texts(request) == "<11><1" and request.events[-2:] == [("finish", 0, "stop"), request.events[-1]]
    assert request.events[-1][0] == "done"


def test_length_and_stop_tokens_emit_all_the_text_once():
    request = make_request([4], max_tokens=3, stop=["zzz"])
    assert push_all(request, [5, 6, 7, 8]) == "length" and texts(request) == "<5><6><7>"
    stopped = make_request([4], max_tokens=9, stop_ids={3})
    assert push_all(stopped, [5, 3]) == "stop" and texts(stopped) == "<5>"
    assert [e for e in stopped.events if e[0] == "finish"] == [("finish", 0, "stop")]
    usage = stopped.events[-1][1]
    assert usage["completion_tokens"] == 2 and usage["prompt_tokens"] == 1 and usage["total_tokens"] == 3


def test_what_a_finished_choice_leaves_to_park():
    """The cache has read the prompt and every generated token but the last; a final stop token is
    not part of the conversation, any other last token is, unfed."""
    stopped = make_request([4, 5], max_tokens=9, stop_ids={3})
    push_all(stopped, [6, 7, 3])
    assert stopped.choices[0].conversation()[:2] == ([4, 5, 6, 7], 4)
    cut = make_request([4, 5], max_tokens=3)
    push_all(cut, [6, 7, 8])
    assert cut.choices[0].conversation()[:2] == ([4, 5, 6, 7, 8], 4)


def test_metrics_render_as_prometheus_text():
    metrics = Metrics()
    metrics.gauges = lambda: {"rows_in_use": ("Rows.", 2)}
    metrics.add("generation_tokens_total", 5)
    metrics.finished("length")
    values = parse(metrics.render())
    assert values["rows_in_use"] == 2 and values["generation_tokens_total"] == 5
    assert values['requests_finished_total{reason="length"}'] == 1
    assert values['requests_finished_total{reason="cancelled"}'] == 0
    with pytest.raises(KeyError):
        metrics.add("no_such_counter")
