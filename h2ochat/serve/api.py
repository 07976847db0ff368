"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, checked into ``RequestParams``.

The bodies are pydantic models (``ChatBody``, ``CompletionBody``): lenient where clients differ
(unknown fields are ignored: LangChain, LiteLLM and Open WebUI send many; ``max_completion_tokens``
is the newer name of ``max_tokens``), strict where a wrong value would silently change the answer
(strict types: no string for a number, no 1 for true). A failure is a 400 naming the field
(``param``, the OpenAI error's), never a bare 422.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

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
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit at every step
    # OpenAI's penalties: a token's logit loses frequency_penalty per time it was generated, and
    # presence_penalty once it was generated at all (the reply's tokens, not the prompt's, as vLLM)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


Number = Union[StrictInt, StrictFloat]


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class Message(_Body):
    role: Literal[ROLES]
    content: Union[StrictStr, list[TextPart], None] = None
    tool_calls: object = None
    function_call: object = None


class StreamOptions(_Body):
    include_usage: StrictBool | None = None


class _Common(_Body):
    model: Annotated[StrictStr, Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    n: Annotated[StrictInt, Field(ge=1)] | None = None
    stop: Union[StrictStr, Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)], None] = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    logit_bias: dict[StrictStr, Annotated[Number, Field(ge=-100, le=100)]] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    # fields whose absence of support would change the answer the client expects (refused when set)
    logprobs: object = None
    top_logprobs: object = None
    echo: object = None
    best_of: object = None
    tools: object = None
    functions: object = None
    suffix: object = None
    response_format: object = None
    modalities: object = None
    audio: object = None
    prediction: object = None
    web_search_options: object = None
    tool_choice: object = None
    function_call: object = None  # (the older tool_choice)


class ChatBody(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]


class CompletionBody(_Common):
    prompt: Union[StrictStr, list[Annotated[StrictInt, Field(ge=0)]], list[Union[StrictStr, list[StrictInt]]]]


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # (brackets nested deeper than Python's parser recurses)
        raise invalid("The request body is not valid JSON for this server: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    return body


# the param a failure names, by the field it is in (the OpenAI API names the whole field)
PARAM_OF = {"top_logprobs": "logprobs", "functions": "tools"}
# what a field of more than one type must be (pydantic would name only its first type)
EXPECTED = {"temperature": "a number in [0, 2]", "top_p": "a number in (0, 1]",
            "stop": f"a string or a list of at most {MAX_STOP_STRINGS} strings", "stream_options": "an object",
            "prompt": "a non-empty string or a list of token ids", "content": "a string or a list of text parts",
            "frequency_penalty": "a number in [-2, 2]", "presence_penalty": "a number in [-2, 2]",
            "logit_bias": "an object of token ids (as strings) to numbers in [-100, 100]"}


def _refusal(error: ValidationError, body: dict) -> Exception:
    """The 400 for pydantic's complaint: the field's name as the param, where in it and why. A value
    that fits none of a field's types gives one complaint per type, all under the field's path:
    the message then says what the field must be (``EXPECTED``)."""
    complaints = error.errors(include_url=False)
    first = complaints[0]
    location = first["loc"]
    if len(complaints) > 1:  # (the path the complaints share: the field a union's branches failed for)
        shared = [c["loc"] for c in complaints if c["loc"][:1] == location[:1]]
        location = tuple(steps[0] for steps in zip(*shared) if len(set(steps)) == 1)
    name = str(location[0])
    param = PARAM_OF.get(name, name) if location[:2] != ("stream_options", "include_usage") else "include_usage"
    where, last, value = name, name, body.get(name)
    for step in location[1:]:
        if isinstance(step, int):
            where, value = f"{where}[{step}]", value[step] if isinstance(value, list) else None
        else:
            where, last, value = f"{where}.{step}", step, value.get(step) if isinstance(value, dict) else None
    if first["type"] == "missing":
        return invalid(f"{where} must be given", param=param)
    if first["type"] == "too_short" and name == "messages":
        return invalid("messages must not be empty", param=param)
    shown = json.dumps(value)
    if first["loc"] != location:
        return invalid(f"{where} must be {EXPECTED.get(last, 'of another type')}, got {shown}", param=param)
    return invalid(f"{where}: {first['msg'][0].lower()}{first['msg'][1:]}, got {shown}", param=param)


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


def _messages(messages: list[Message]) -> list[dict]:
    checked = []
    for number, message in enumerate(messages):
        where = f"messages[{number}]"
        if message.tool_calls or message.function_call:
            raise invalid(f"{where}: tool calls are not supported", param="messages")
        content = message.content
        if content is None:
            raise invalid(f"{where} has no content", param="messages")
        if isinstance(content, str):
            text = _unicode(content, f"{where}.content")
        else:
            text = "".join(_unicode(part.text, f"{where}.content[{index}].text") for index, part in enumerate(content))
        # "developer" is the newer name of "system"; chat templates know the older one
        checked.append({"role": "system" if message.role == "developer" else message.role, "content": text})
    return checked


def _prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", param="prompt")
        return _unicode(prompt, "prompt")
    if prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
        return prompt
    if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("one prompt per request: send several requests (or n) for several completions", param="prompt")
    raise invalid("prompt must be a non-empty string or a list of token ids", param="prompt")


def _refuse_unsupported(body: _Common) -> None:
    if body.logprobs not in (None, False, 0) or body.top_logprobs not in (None, 0):
        raise invalid("logprobs are not supported by this server", param="logprobs")
    if body.echo:
        raise invalid("echo is not supported by this server", param="echo")
    if body.best_of not in (None, 1):
        raise invalid("best_of is not supported by this server", param="best_of")
    if body.tools or body.functions:
        raise invalid("tools are not supported by this server", param="tools")
    if body.suffix:
        raise invalid("suffix is not supported by this server", param="suffix")
    if body.response_format is not None and body.response_format != {"type": "text"}:
        raise invalid("response_format: only {\"type\": \"text\"} is supported by this server (no structured "
                      "output: the reply would not be held to the format asked)", param="response_format")
    if body.modalities is not None and body.modalities != ["text"]:
        raise invalid("modalities: only [\"text\"] is supported by this server", param="modalities")
    for name in ("audio", "prediction", "web_search_options"):
        if getattr(body, name) is not None:
            raise invalid(f"{name} is not supported by this server", param=name)
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none"):
            raise invalid(f"{name}: tools are not supported by this server (only \"none\")", param=name)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """``logit_bias``'s keys as token ids: JSON keys are strings, each must spell a token id."""
    checked = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise invalid(f"logit_bias: keys must be token ids written as strings (\"50256\"), got {json.dumps(key)}",
                          param="logit_bias")
        checked[int(key)] = float(value)
    return checked


def parse_request(body: dict, kind: str, *, max_n: int) -> RequestParams:
    """Check a chat (``kind="chat"``) or completion request body; raises ``APIError`` (400)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:  # (first, as before: a client without a model learns that first)
        raise invalid("model must be given as a string (see GET /v1/models)", param="model")
    try:
        checked = (ChatBody if kind == "chat" else CompletionBody).model_validate(body)
    except ValidationError as error:
        raise _refusal(error, body) from None
    _refuse_unsupported(checked)
    n = checked.n if checked.n is not None else 1
    if n > max_n:
        raise invalid(f"n must be in [1, {max_n}], got {n}", param="n")
    stop = [checked.stop] if isinstance(checked.stop, str) else (checked.stop or [])
    max_tokens = checked.max_completion_tokens if checked.max_completion_tokens is not None else checked.max_tokens
    options = checked.stream_options
    params = RequestParams(
        kind=kind,
        model=checked.model,
        max_tokens=max_tokens,
        temperature=float(checked.temperature if checked.temperature is not None else 1.0),
        top_p=float(checked.top_p if checked.top_p is not None else 1.0),
        stop=[_unicode(s, "stop") for s in stop if s],
        seed=checked.seed,
        n=n,
        stream=bool(checked.stream),
        include_usage=bool(options and options.include_usage),
        ignore_eos=bool(checked.ignore_eos),
        skip_special_tokens=checked.skip_special_tokens is None or checked.skip_special_tokens,
        logit_bias=_logit_bias(checked.logit_bias),
        frequency_penalty=float(checked.frequency_penalty or 0.0),
        presence_penalty=float(checked.presence_penalty or 0.0),
    )
    if kind == "chat":
        params.messages = _messages(checked.messages)
    else:
        params.prompt = _prompt(checked.prompt)
    return params
