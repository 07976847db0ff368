"""The HTTP side: a Starlette application in front of the engine.

Handlers never touch the model: they check the request, tokenize it in a worker thread, hand it to
the engine and wait on an ``asyncio.Queue`` the engine thread fills through
``loop.call_soon_threadsafe``. A client that goes away (a closed stream, a dropped connection while
waiting for a whole response) cancels its request, which frees its rows at the engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .api import parse_json, parse_request
from .engine import Engine
from .errors import APIError, loading, model_not_found, server_error, unauthorized
from .responses import Shapes, sse

log = logging.getLogger("h2ochat.serve")

OPEN_PATHS = ("/health", "/metrics")  # no key needed, as llama.cpp's server
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks its client is still there


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def build_app(engine: Engine, *, api_key: str | None = None, started: int | None = None) -> Starlette:
    created = started or int(time.time())

    def ready_engine():
        if engine.load_error:
            raise APIError(503, f"the model failed to load: {engine.load_error}", type="server_error",
                           code="model_load_failed")
        if not engine.ready:
            raise loading()
        return engine.loaded

    async def health(request: HTTPRequest) -> Response:
        if engine.load_error:
            return JSONResponse({"status": "error", "message": engine.load_error}, status_code=503)
        if not engine.ready:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    async def metrics(request: HTTPRequest) -> Response:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "h2ochat"}

    async def models(request: HTTPRequest) -> Response:
        loaded = ready_engine()
        return JSONResponse({"object": "list", "data": [model_card(loaded.model_id)]})

    async def model(request: HTTPRequest) -> Response:
        loaded = ready_engine()
        name = request.path_params["name"]
        if name != loaded.model_id:
            raise model_not_found(name, loaded.model_id)
        return JSONResponse(model_card(name))

    async def generate(request: HTTPRequest, kind: str) -> Response:
        loaded = ready_engine()
        params = parse_request(parse_json(await request.body()), kind, max_n=loaded.backend.rows)
        if params.model != loaded.model_id:
            raise model_not_found(params.model, loaded.model_id)
        prepared = await run_in_threadpool(loaded.preparer, params)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        handle = engine.submit(prepared, _deliver_to(loop, events))
        shapes = Shapes(kind, handle.id, handle.created, loaded.model_id)
        if params.stream:
            return StreamingResponse(_stream(engine, handle, events, shapes, params.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(engine, handle, events, shapes, request)

    async def chat_completions(request: HTTPRequest) -> Response:
        return await generate(request, "chat")

    async def completions(request: HTTPRequest) -> Response:
        return await generate(request, "completion")

    async def on_api_error(request: HTTPRequest, exc: APIError) -> Response:
        return error_response(exc)

    async def on_http_error(request: HTTPRequest, exc: HTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else None
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, message, code=kind))

    async def on_crash(request: HTTPRequest, exc: Exception) -> Response:
        log.exception("request %s %s failed", request.method, request.url.path)
        return error_response(server_error(f"internal error: {type(exc).__name__} (see the server log)"))

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/v1/models/{name:path}", model),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_crash},
    )
    if api_key:
        app.add_middleware(_BearerAuth, key=api_key)
    return app


def _deliver_to(loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
    """The engine thread's ``emit`` for one request: its events go onto ``events`` in ``loop``. Once
    the loop has closed (the server stopped) nobody waits for them: they are dropped, not raised in
    the engine thread."""

    def deliver(event: tuple) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # "Event loop is closed"
            pass

    return deliver


class _BearerAuth:
    """ASGI middleware: every path but /health and /metrics needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                await error_response(unauthorized())(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _stream(engine: Engine, handle, events: asyncio.Queue, shapes: Shapes, include_usage: bool):
    """Server-sent events: each choice's opening role, its text, exactly one chunk with its finish
    reason, then (when asked) the usage chunk, then ``[DONE]``. An error is one event in the OpenAI
    error shape. Leaving early (the client closed the stream) cancels the request."""
    try:
        if shapes.kind == "chat":
            for index in range(handle.n):
                yield sse(shapes.chunk(index, role=True))
        while True:
            event = await events.get()
            kind = event[0]
            if kind == "text":
                yield sse(shapes.chunk(event[1], event[2]))
            elif kind == "finish":
                yield sse(shapes.chunk(event[1], finish=event[2]))
            elif kind == "done":
                if include_usage:
                    yield sse(shapes.usage_chunk(event[1]))
                break
            elif kind == "error":
                yield sse(event[1].body())
                break
        yield sse("[DONE]")
    finally:
        if not handle.finished:
            engine.cancel(handle)


async def _whole(engine: Engine, handle, events: asyncio.Queue, shapes: Shapes, request: HTTPRequest) -> Response:
    texts, reasons = [""] * handle.n, ["stop"] * handle.n
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(handle)
                    return Response(status_code=499)
                continue
            kind = event[0]
            if kind == "text":
                texts[event[1]] += event[2]
            elif kind == "finish":
                reasons[event[1]] = event[2]
            elif kind == "done":
                return JSONResponse(shapes.whole(texts, reasons, event[1]))
            elif kind == "error":
                return error_response(event[1])
    finally:
        if not handle.finished:
            engine.cancel(handle)
