"""A multi-turn conversation on one H2O cache: messages, settings, and feeding only what is new.

The cache keeps what the model has read, so a new user turn must not re-read the dialogue. The
conversation remembers the text (rendered chat template) its cache has been fed; for a new turn
it renders the whole conversation again and feeds only the suffix past that text. When the
rendered history no longer starts with what was fed (system prompt changed, a template that
rewrites earlier turns), it starts a fresh cache and feeds everything: correct, just slower.

This module knows nothing about terminals: the REPL (repl.py) and the renderers (ui.py) sit on top.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch

from .cache import H2OCache
from .generation import CacheSettings, Sampling, TextStream, Timing, max_positions, prefill, stream
from .prompting import has_chat_template

FORMAT_VERSION = 1

# tokens that end an assistant turn in common chat templates, besides the tokenizer's eos
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")

# what `/set NAME VALUE` accepts: canonical name -> (parser, aliases)
_SETTABLE: dict[str, tuple[Callable[[str], object], tuple[str, ...]]] = {
    "temperature": (float, ("temp", "t")),
    "top_p": (float, ("top-p", "topp")),
    "top_k": (int, ("top-k", "topk")),
    "repetition_penalty": (float, ("repetition-penalty", "repeat_penalty", "repeat-penalty")),
    "repeat_last_n": (int, ("repeat-last-n", "last_n", "last-n")),
    "seed": (lambda v: None if v.lower() in ("none", "off", "random") else int(v), ()),
    "max_new_tokens": (int, ("max-new-tokens", "max_tokens", "max-tokens", "num_predict")),
    "system": (str, ("system_prompt",)),
    "heavy_ratio": (float, ("heavy-ratio",)),
}


@dataclass
class ChatSettings:
    """Everything that shapes a reply; saved with the conversation."""

    system: str | None = None
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64  # the penalty looks at this many recent tokens (0 = the whole text)
    max_new_tokens: int = 512
    cache: CacheSettings = field(default_factory=CacheSettings)

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                        repetition_penalty=self.repetition_penalty, repeat_last_n=self.repeat_last_n)

    def validate(self) -> None:
        self.sampling().validate()
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        self.cache.validate()

    def set(self, name: str, value: str) -> str:
        """Change one setting from text (``/set temperature 0.7``); returns its canonical name.
        Raises ValueError, leaving the settings as they were, for an unknown name or bad value."""
        key = name.strip().lower()
        canonical = next((k for k, (_, aliases) in _SETTABLE.items() if key == k or key in aliases), None)
        if canonical is None:
            raise ValueError(f"cannot set {name!r}; settable: {', '.join(_SETTABLE)}")
        parser = _SETTABLE[canonical][0]
        try:
            parsed = parser(value.strip())
        except ValueError:
            raise ValueError(f"{canonical} needs a {parser.__name__ if parser in (int, float) else 'valid'} value, "
                             f"got {value.strip()!r}") from None
        if canonical == "system":
            parsed = parsed or None
        target = self.cache if canonical == "heavy_ratio" else self
        old = getattr(target, canonical)
        setattr(target, canonical, parsed)
        try:
            self.validate()
        except ValueError:
            setattr(target, canonical, old)
            raise
        return canonical

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ChatSettings":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "cache"}
        cache_fields = CacheSettings.__dataclass_fields__
        cache = CacheSettings(**{k: v for k, v in (data.get("cache") or {}).items() if k in cache_fields})
        settings = cls(**known, cache=cache)
        settings.validate()
        return settings


@dataclass
class TurnResult:
    text: str
    interrupted: bool
    timing: Timing
    evicted: float  # tokens evicted during this turn, per (layer, KV head) on average
    notices: list[str]


def evicted_per_head(cache: H2OCache) -> float:
    """Tokens evicted so far, averaged over (layer, sequence, KV head): 'how many tokens are gone'."""
    rows = sum(layer.evicted.numel() for layer in cache.layers if layer.is_initialized)
    return cache.evicted_tokens() / rows if rows else 0.0


def stop_token_ids(tokenizer, model=None) -> set[int]:
    """Ids that end a reply: eos, the generation config's eos list, end-of-turn markers. The one stopping
    rule of every command (run, generate, story --stop-at-eos), so a model that closes its turn with
    <|im_end|> stops everywhere, not only in the chat."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]:
        if value is not None:
            ids.add(int(value))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[name] for name in END_OF_TURN if name in vocab)
    return ids


def inference_steps(steps: Iterator):
    """Advance a generation stream in inference mode. Each forward already is, but between forwards
    the cache may re-number positions, rotating its (inference-mode) keys in place, which torch
    refuses outside inference mode."""
    while True:
        with torch.inference_mode():
            try:
                item = next(steps)
            except StopIteration:
                return
        yield item


class Conversation:
    """Messages, settings and the cache holding what the model has read of them.

    Invariants between turns: ``ids`` are the tokens the cache has been fed, in order (token index
    i of the cache is ``ids[i]``); ``pending`` are tokens produced but not fed yet (the last
    generated token); ``fed_text`` is the rendered text that ``ids + pending`` spell.
    """

    def __init__(self, model, tokenizer, settings: ChatSettings | None = None, *, prefill_chunk: int = 512,
                 compile: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.settings = settings or ChatSettings()
        self.settings.validate()
        self.prefill_chunk = prefill_chunk
        self.compile = compile  # decode steps through h2ochat.compiled (the cache is reused: exact stops)
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.messages: list[dict] = []
        self.stop_requested = False  # set (by a Ctrl-C handler) to end the reply after this token
        self.hangup: int | None = None  # the signal (SIGHUP, SIGTERM) that ended the session mid-reply
        self.current: Timing | None = None  # the turn being generated, for live statistics
        self._hard_stop = False  # Ctrl-C twice: the last forward may have been cut half-way
        self.warned: set[str] = set()  # eviction notices already given (once per conversation)
        self._new_cache()

    # -- state ------------------------------------------------------------------------------------
    def _new_cache(self) -> None:
        self.cache = self.settings.cache.build(self.model)
        self.ids: list[int] = []
        self.pending: list[int] = []
        self.fed_text = ""
        # token index where each turn (user message + reply) starts; before the first: the system
        # prompt and the template's header. Feeds /cache's per-part figures and the eviction notes.
        self.turn_starts: list[int] = []

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_positions(self) -> int:
        return max_positions(self.model.config)

    def clear(self) -> None:
        """A new conversation with a fresh cache (settings kept)."""
        self.messages = []
        self.warned = set()
        self._new_cache()

    def rebuild(self) -> int:
        """A fresh cache with the current cache settings, fed the whole conversation again.
        Returns the number of tokens re-fed."""
        self.cache.layers.clear()  # let the old slots go before the new ones are allocated
        self._new_cache()
        if not self.messages:
            return 0
        text = self.render(add_generation_prompt=False)
        ids = self.encode(text)
        if ids:
            with torch.inference_mode():
                prefill(self.model, self.cache, torch.tensor([ids], device=self.device), chunk=self.prefill_chunk)
        self.ids, self.fed_text = ids, text
        self._mark_turns(text)
        return len(ids)

    # -- templates --------------------------------------------------------------------------------
    def chat_messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return system + [{"role": m["role"], "content": m["content"]} for m in self.messages]

    @property
    def plain_transcript(self) -> bool:
        """No chat template: the conversation is rendered as a 'User: / Assistant:' transcript."""
        return not has_chat_template(self.tokenizer)

    def render(self, add_generation_prompt: bool) -> str:
        messages = self.chat_messages()
        if not self.plain_transcript:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        # base models: a plain transcript they can continue
        # "Assistant:" without a space: the model writes its own leading space, as after the prompt
        names = {"system": "", "user": "User: ", "assistant": "Assistant:"}
        text = "".join(f"{names.get(m['role'], m['role'] + ': ')}{m['content']}\n\n" for m in messages)
        return text + ("Assistant:" if add_generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        # the rendered template carries its own special tokens (BOS included when it wants one)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    # -- a turn -----------------------------------------------------------------------------------
    def send(self, user_text: str, on_piece: Callable[[str], None] | None = None) -> TurnResult:
        """Add a user message and generate the reply, streaming text pieces to ``on_piece``.

        Ends early, keeping the partial reply (marked interrupted), when ``stop_requested`` is set
        or KeyboardInterrupt is raised (by ``on_piece`` or a Ctrl-C handler).
        """
        settings = self.settings
        notices: list[str] = []
        self.messages.append({"role": "user", "content": user_text})
        target = self.render(add_generation_prompt=True)
        if self.fed_text and target.startswith(self.fed_text):
            new_ids = self.pending + self.encode(target[len(self.fed_text):])
            self.turn_starts.append(len(self.ids) + len(self.pending))  # the pending token ends the last reply
        else:
            if self.ids:
                notices.append("feeding the whole conversation again into a fresh cache (its start changed or a reply was cut mid-step)")
            self.cache.layers.clear()
            self._new_cache()
            new_ids = self.encode(target)
            self._mark_turns(target)
        base = len(self.ids)
        evicted_before = evicted_per_head(self.cache)
        timing, pieces, generated = Timing(), TextStream(self.tokenizer), []
        self.current, self.stop_requested, interrupted = timing, False, False
        self._hard_stop = False
        try:
            steps = stream(self.model, self.cache, torch.tensor([new_ids], device=self.device),
                           max_new_tokens=settings.max_new_tokens, sampling=settings.sampling(),
                           stop_ids=self.stop_ids, prefill_chunk=self.prefill_chunk, timing=timing,
                           compile=self.compile)
            for step in inference_steps(steps):
                generated.append(int(step.tokens[0]))
                piece = pieces.push(generated[-1])
                if on_piece is not None and piece:
                    on_piece(piece)
                if self.stop_requested:
                    interrupted = True
                    break
                if self.plain_transcript and "\nUser:" in pieces.text:
                    break  # a base model starts writing the user's part: the reply is over
        except KeyboardInterrupt:
            interrupted = True
        except Exception:
            # a failed turn leaves no trace but forces the next one to start from a fresh cache
            self.messages.pop()
            self.fed_text = ""
            raise
        finally:
            self.current = None
        # The reply as the template will render it next turn: special tokens the model wrote inside
        # it stay, so the rendered history still starts with what the cache was fed. A final stop
        # token was never fed: drop it and let the template close the turn its own way.
        body = generated[:-1] if generated and generated[-1] in self.stop_ids else generated
        content = self.tokenizer.decode(body, skip_special_tokens=False)
        self._account(base, new_ids + body, target + content)
        reply = {"role": "assistant", "content": content}
        if interrupted:
            reply["interrupted"] = True
        self.messages.append(reply)
        notices += self.eviction_notices()
        return TurnResult(pieces.text, interrupted, timing, evicted_per_head(self.cache) - evicted_before, notices)

    def _account(self, base: int, tokens: list[int], text: str) -> None:
        """Record what the cache now holds after feeding (part of) ``tokens`` on top of ``base``."""
        seen = {layer.seen for layer in self.cache.layers if layer.is_initialized} or {base}
        fed = seen.pop() - base if len(seen) == 1 and not self._hard_stop else -1
        if not 0 <= fed <= len(tokens):
            # stopped in the middle of a forward: layers disagree; start over at the next turn
            self.fed_text = ""
            return
        self.ids += tokens[:fed]
        self.pending = tokens[fed:]
        self.fed_text = text

    def _mark_turns(self, text: str) -> None:
        """Where each turn starts, in tokens, for a conversation fed whole as ``text``: the first
        after the system prompt and header, each later one where the messages before it end."""
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        self.turn_starts = []
        if not users:
            return
        at = text.find(self.messages[users[0]]["content"])
        self.turn_starts.append(len(self.encode(text[:at])) if at > 0 else 0)
        self.turn_starts += [len(self.encode(self.render_prefix(i))) for i in users[1:]]

    def render_prefix(self, count: int) -> str:
        saved = self.messages
        try:
            self.messages = saved[:count]
            return self.render(add_generation_prompt=False)
        finally:
            self.messages = saved

    def parts(self) -> list[tuple[str, int, int]]:
        """The conversation's parts as (name, first token, end token): the system prompt (with the
        template's header) and each turn, for the cache statistics of what is still held."""
        end = len(self.ids) + len(self.pending)
        starts = self.turn_starts
        parts = []
        if starts and starts[0] > 0:
            parts.append(("system prompt" if self.settings.system else "header", 0, starts[0]))
        users = [m for m in self.messages if m["role"] == "user"]
        for number, start in enumerate(starts):
            stop = starts[number + 1] if number + 1 < len(starts) else end
            first = users[number]["content"].strip().splitlines()[0] if number < len(users) and users[number]["content"].strip() else ""
            parts.append((f"turn {number + 1}" + (f": {first}" if first else ""), start, stop))
        return parts

    def eviction_notices(self) -> list[str]:
        """One-time notes when the system prompt or the first turn start leaving the cache."""
        if not self.cache.budget.evicts or not self.cache.initialized or not self.turn_starts:
            return []
        share = self.cache.cached_token_share()
        notes = []
        starts = self.turn_starts + [len(self.ids) + len(self.pending)]
        spans = {"system prompt": (0, starts[0])} if self.settings.system else {}
        spans["first turn"] = (starts[0], starts[1])
        for name, (start, end) in spans.items():
            end = min(end, share.numel())
            if name not in self.warned and end > start and float(share[start:end].min()) < 1.0:
                self.warned.add(name)
                kept = float(share[start:end].mean())
                notes.append(f"the {name} is being evicted from the cache ({kept:.0%} of its slots still held; "
                             "heavy hitters stay)")
        return notes

    # -- saving -----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": "h2ochat-conversation", "version": FORMAT_VERSION,
                "settings": self.settings.to_json(), "messages": [dict(m) for m in self.messages]}

    def load_json(self, data: dict) -> int:
        """Replace messages and settings with a saved conversation; returns tokens re-fed."""
        if not isinstance(data, dict) or data.get("format") != "h2ochat-conversation":
            raise ValueError("not an h2ochat conversation file")
        messages = data.get("messages")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError("the conversation file has no valid message list")
        settings = ChatSettings.from_json(data.get("settings") or {})
        self.settings, self.messages = settings, [dict(m) for m in messages]
        return self.rebuild()


@contextmanager
def ctrl_c_stops(conversation: Conversation):
    """While active, a first Ctrl-C ends the reply cleanly after the current token (the cache stays
    consistent); a second one interrupts at once (the cache is then rebuilt next turn). A closed
    terminal (SIGHUP) or SIGTERM also ends the reply after the current token and is recorded in
    ``conversation.hangup``, so the partial reply is kept before the session leaves."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if conversation.stop_requested:
            conversation._hard_stop = True
            raise KeyboardInterrupt
        conversation.stop_requested = True

    def hangup(signum, frame):
        conversation.hangup = signum
        conversation.stop_requested = True

    watched = [signal.SIGINT] + [getattr(signal, name) for name in ("SIGHUP", "SIGTERM") if hasattr(signal, name)]
    previous = {number: signal.signal(number, handler if number == signal.SIGINT else hangup) for number in watched}
    try:
        yield
    finally:
        for number, action in previous.items():
            signal.signal(number, action)
