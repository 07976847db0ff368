"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, checked into ``RequestParams``.

Lenient where clients differ (unknown fields are ignored: LangChain, LiteLLM and Open WebUI send
many; ``max_completion_tokens`` is the newer name of ``max_tokens``), strict where a wrong value
would silently change the answer (a type error or an unsupported feature is a 400 naming the field,
never a bare 422).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .errors import invalid

ROLES = ("system", "developer", "user", "assistant")
MAX_STOP_STRINGS = 4  # as the OpenAI API


@dataclass
class RequestParams:
    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict] | None = None  # chat: [{"role", "content"}] with text content
    prompt: str | list[int] | None = None  # completion: text or token ids
    max_tokens: int | None = None  # None: as many as the server allows
    temperature: float = 1.0  # the OpenAI default
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # an extension (vLLM's name): generate max_tokens whatever the model's end tokens
    # an extension (vLLM's name): False returns special tokens the model wrote inside its text, so a
    # client that sends the reply back as history sends what the model read (and resumes its cache)
    skip_special_tokens: bool = True


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    return body


def _number(body: dict, name: str, default, low: float, high: float, *, integer: bool = False, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise invalid(f"{name} must be {kind}, got {json.dumps(value)}", param=name)
    if value < low or (low_open and value == low) or value > high:
        bound = f"({low}" if low_open else f"[{low}"
        raise invalid(f"{name} must be in {bound}, {high}], got {value}", param=name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {json.dumps(value)}", param=name)
    return value


def _unicode(text: str, param: str) -> str:
    """``text`` if it is Unicode text the tokenizer can take. JSON may spell a lone UTF-16 surrogate
    (``"\\ud800"``), which is no character: Python keeps it in the string and the tokenizer then raises
    a TypeError deep in its Rust code, so it is refused here, naming where it was."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(f"{param} is not valid Unicode text: a lone surrogate {text[exc.start]!r} at character "
                      f"{exc.start} (a UTF-16 surrogate must come in a pair)", param=param) from None
    return text


def _text_content(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined); other parts are refused."""
    if isinstance(content, str):
        return _unicode(content, f"{where}.content")
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid(f"{where}: only text content parts are supported", param="messages")
            texts.append(_unicode(part["text"], f"{where}.content[{number}].text"))
        return "".join(texts)
    raise invalid(f"{where}.content must be a string or a list of text parts", param="messages")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("messages must be a list of {role, content} objects", param="messages")
    if not messages:
        raise invalid("messages must not be empty", param="messages")
    checked = []
    for number, message in enumerate(messages):
        where = f"messages[{number}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object with role and content", param="messages")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {json.dumps(role)}", param="messages")
        if message.get("tool_calls") or message.get("function_call"):
            raise invalid(f"{where}: tool calls are not supported", param="messages")
        content = message.get("content")
        if content is None:
            raise invalid(f"{where} has no content", param="messages")
        # "developer" is the newer name of "system"; chat templates know the older one
        checked.append({"role": "system" if role == "developer" else role, "content": _text_content(content, where)})
    return checked


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", param="prompt")
        return _unicode(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("one prompt per request: send several requests (or n) for several completions", param="prompt")
    raise invalid("prompt must be a non-empty string or a list of token ids", param="prompt")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise invalid("stop must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    return [_unicode(s, "stop") for s in stop if s]


def _refuse_unsupported(body: dict) -> None:
    """Fields whose absence of support would change the answer the client expects."""
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise invalid("logprobs are not supported by this server", param="logprobs")
    if body.get("echo"):
        raise invalid("echo is not supported by this server", param="echo")
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of is not supported by this server", param="best_of")
    if body.get("tools") or body.get("functions"):
        raise invalid("tools are not supported by this server", param="tools")
    if body.get("suffix"):
        raise invalid("suffix is not supported by this server", param="suffix")


def parse_request(body: dict, kind: str, *, max_n: int) -> RequestParams:
    """Check a chat (``kind="chat"``) or completion request body; raises ``APIError`` (400)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model must be given as a string (see GET /v1/models)", param="model")
    _refuse_unsupported(body)
    max_tokens = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body.get("max_tokens"), "max_tokens"
    if max_tokens is not None:
        max_tokens = _number({name: max_tokens}, name, None, 1, float("inf"), integer=True)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be an object", param="stream_options")
    params = RequestParams(
        kind=kind,
        model=model,
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)),
        stop=_stop(body),
        seed=_number(body, "seed", None, -(2**63), 2**63 - 1, integer=True),
        n=_number(body, "n", 1, 1, max_n, integer=True),
        stream=_flag(body, "stream"),
        include_usage=_flag(options or {}, "include_usage"),
        ignore_eos=_flag(body, "ignore_eos"),
        skip_special_tokens=body.get("skip_special_tokens") is None or _flag(body, "skip_special_tokens"),
    )
    if kind == "chat":
        params.messages = _messages(body)
    else:
        params.prompt = _prompt(body)
    return params
