"""The HTTP application in-process with a fake engine behind it (ASGI calls, no sockets): /health
says 503 while the model loads and when it failed to load; an error after a stream began is one
event in the OpenAI shape, then [DONE]; routes and methods that do not exist answer in that shape."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from h2ochat.engine.generation import Sampling
from h2ochat.serve.app import build_app
from h2ochat.serve.engine import Engine, Loaded
from h2ochat.serve.metrics import Metrics
from h2ochat.serve.parked import ParkedStore
from h2ochat.serve.sequence import Prepared

from serve_fakes import FakeBackend, FakeTokenizer


def call(app, method: str, path: str, body: dict | None = None) -> tuple[int, dict, bytes]:
    """One ASGI request: (status, headers, body)."""

    async def run():
        pending = [{"type": "http.request", "body": json.dumps(body).encode() if body else b"", "more_body": False}]
        sent = []

        async def receive():
            if pending:
                return pending.pop(0)
            await asyncio.sleep(3600)  # the client stays connected

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
                b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))

    return asyncio.run(run())


def fake_loaded(backend: FakeBackend) -> Loaded:
    def prepare(params):
        return Prepared(params, list(params.prompt), None, params.max_tokens or 5, Sampling(temperature=0))

    return Loaded(backend, FakeTokenizer(), prepare, frozenset({3}), "fake")


def make_engine(load) -> Engine:
    store = ParkedStore(0)
    return Engine(load, store=store, metrics=Metrics(), max_queue=4)


def wait(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


REQUEST = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 4}


def test_health_is_503_while_the_model_loads_then_200():
    release = threading.Event()
    backend = FakeBackend(rows=2)

    def load():
        release.wait(10)
        return fake_loaded(backend)

    engine = make_engine(load)
    app = build_app(engine)
    engine.start()
    try:
        status, headers, body = call(app, "GET", "/health")
        assert status == 503 and json.loads(body) == {"status": "loading"} and headers["retry-after"] == "1"
        status, _, body = call(app, "POST", "/v1/completions", REQUEST)
        assert status == 503 and json.loads(body)["error"]["code"] == "model_loading"
        release.set()
        wait(lambda: engine.ready)
        assert call(app, "GET", "/health")[0] == 200
        status, _, body = call(app, "POST", "/v1/completions", REQUEST)
        assert status == 200 and json.loads(body)["choices"][0]["text"]
    finally:
        release.set()
        engine.stop()


def test_a_model_that_failed_to_load_is_reported():
    def load():
        raise ValueError("no such weights")

    engine = make_engine(load)
    app = build_app(engine)
    engine.start()
    wait(lambda: engine.load_error is not None)
    status, _, body = call(app, "GET", "/health")
    assert status == 503 and json.loads(body) == {"status": "error", "message": "no such weights"}
    status, _, body = call(app, "POST", "/v1/completions", REQUEST)
    assert status == 503 and "no such weights" in json.loads(body)["error"]["message"]


def test_an_error_after_the_stream_began_is_an_event_and_the_server_goes_on():
    backend = FakeBackend(rows=2)
    engine = make_engine(lambda: fake_loaded(backend))
    app = build_app(engine)
    engine.start()
    try:
        wait(lambda: engine.ready)
        backend.fail_prefill = True
        status, _, body = call(app, "POST", "/v1/completions", {**REQUEST, "stream": True})
        events = [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]
        assert status == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
        backend.fail_prefill = False
        status, _, body = call(app, "POST", "/v1/completions", {**REQUEST, "stream": True})
        events = [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]
        assert status == 200 and [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]] == [
            None, None, None, None, "length"]
    finally:
        engine.stop()


def test_unknown_routes_and_methods_answer_in_the_openai_shape():
    engine = make_engine(lambda: fake_loaded(FakeBackend(rows=1)))
    app = build_app(engine)
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)):
        got, _, body = call(app, method, path)
        assert got == status and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
