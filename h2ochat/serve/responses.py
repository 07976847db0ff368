"""The JSON a client expects back: whole completions and the chunks of a stream, in the OpenAI shapes
(``chat.completion`` / ``chat.completion.chunk`` and ``text_completion``)."""

from __future__ import annotations

import json


class Shapes:
    """Response bodies for one request of ``kind`` ("chat" or "completion")."""

    def __init__(self, kind: str, request_id: str, created: int, model: str):
        self.kind, self.created, self.model = kind, created, model
        self.id = response_id(kind, request_id)

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}

    def chunk(self, index: int, text: str | None = None, *, role: bool = False, finish: str | None = None) -> dict:
        """One streamed chunk for choice ``index``: new text, the opening role, or the finish reason."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [], usage=usage)

    def whole(self, texts: list[str], reasons: list[str], usage: dict) -> dict:
        """A complete (non-streamed) response."""
        if self.kind == "chat":
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": reason} for i, (text, reason) in enumerate(zip(texts, reasons))]
            return self._envelope("chat.completion", choices, usage=usage)
        choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                   for i, (text, reason) in enumerate(zip(texts, reasons))]
        return self._envelope("text_completion", choices, usage=usage)


def response_id(kind: str, request_id: str) -> str:
    """The id a client sees for the engine's request ``request_id`` (the server log names it too)."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
