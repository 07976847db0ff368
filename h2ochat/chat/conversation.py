"""A multi-turn conversation on one H2O cache: messages, and feeding only what is new.

The cache keeps what the model has read, so a new user turn must not re-read the dialogue. The
conversation remembers the text (rendered chat template) its cache has been fed; for a new turn
it renders the whole conversation again and feeds only the suffix past that text. When the
rendered history no longer starts with what was fed (system prompt changed, a template that
rewrites earlier turns), it starts a fresh cache and feeds everything: correct, just slower.

Its settings (``ChatSettings``, ``SETTINGS``, ``check_fits``) live in settings.py, how a reply ends
and streams (stop ids, ``ReplyText`` held back at the base model's stop mark) in replies.py, the
tokens evicted per head in split.py with the cache's other figures. Saving (``to_json``/``load_json``)
and Ctrl-C (``ctrl_c_stops``) stay here: both reach into the conversation's own state.

This module knows nothing about terminals: the REPL (repl.py) and the renderers (ui.py, status.py, cache_view.py) sit on top.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from .settings import ChatSettings, check_fits
from ..kv import H2OCache
from ..engine.detokenize import CONTEXT_IDS, TextStream, decode_in_context
from ..errors import UserError
from ..engine.generation import Timing, decoder, inference_steps, max_positions, prefill, stop_check_interval, stream
from .prompting import has_chat_template
from .prompt_progress import tokens_read
from .replies import STOP_MARK, ReplyText, stop_token_ids
from .split import evicted_per_head


FORMAT_VERSION = 1


@dataclass
class TurnResult:
    text: str
    interrupted: bool
    timing: Timing
    evicted: float  # tokens evicted during this turn, per (layer, KV head) on average
    notices: list[str]
    # a turn stopped while its prompt was read: (tokens read, of how many, seconds); None otherwise
    stopped_reading: tuple[int, int, float] | None = None


class Conversation:
    """Messages, settings and the cache holding what the model has read of them.

    Invariants between turns: ``ids`` are the tokens the cache has been fed, in order (token index
    i of the cache is ``ids[i]``); ``pending`` are tokens produced but not fed yet (the last
    generated token); ``fed_text`` is the rendered text that ``ids + pending`` spell.
    """

    def __init__(self, model, tokenizer, settings: ChatSettings | None = None, *, prefill_chunk: int = 512,
                 compile: bool = False, stop_check_every: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.settings = settings or ChatSettings()
        self.settings.validate()
        check_fits(self.settings.cache, model)
        self.prefill_chunk = prefill_chunk
        self.compile = compile  # decode steps through h2ochat.engine.compiled
        # tokens per read-back of the stop check (None: stop_check_interval, 1 on the CPU, 8 on an
        # accelerator): the finished row sits the rest of a burst out, so the cache is fed exactly the
        # reply (see generation.stream); a cache that cannot leave a row out (recall) reads every token
        self.stop_check_every = stop_check_every
        self._decode = None  # the decode step, made at the first turn and kept for all (a compiled one compiles once)
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.messages: list[dict] = []
        self.stop_requested = False  # set (by a Ctrl-C handler) to end the reply after this token
        self.hangup: int | None = None  # the signal (SIGHUP, SIGTERM) that ended the session mid-reply
        self.current: Timing | None = None  # the turn being generated, for live statistics
        # while a turn's prompt is read: (tokens the cache had seen before it, its length, when it began)
        self.reading: tuple[int, int, float] | None = None
        self._on_reading: Callable[[], None] | None = None  # send()'s on_reading, for the turn under way
        self._hard_stop = False  # Ctrl-C twice: the last forward may have been cut half-way
        self._quiet_refeed = False  # the next full re-read is expected (a base model's reply was cut)
        self.warned: set[str] = set()  # eviction notices already given (once per conversation)
        self._new_cache()

    # -- state ------------------------------------------------------------------------------------
    def _new_cache(self) -> None:
        self._install(self.settings.cache.build(self.model), [], "", [])

    def _install(self, cache: H2OCache, ids: list[int], fed_text: str, turn_starts: list[int]) -> None:
        self.cache = cache
        self.ids: list[int] = ids
        self.pending: list[int] = []
        self.fed_text = fed_text
        # token index where each turn (user message + reply) starts; before the first: the system
        # prompt and the template's header. Feeds /cache's per-part figures and the eviction notes.
        self.turn_starts: list[int] = turn_starts

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
        """A fresh cache with the current settings, fed the whole conversation again.
        Returns the number of tokens re-fed."""
        return self.reconfigure(self.settings)

    def use_settings(self, settings: ChatSettings) -> None:
        """Go on with ``settings`` that need no new cache (sampling, the system prompt, reply length;
        a new seed, which a cache draws from only when it is built): the conversation and its cache
        stay. Settings that shape the cache go through ``reconfigure``."""
        self.settings = settings

    def reconfigure(self, settings: ChatSettings, messages: list[dict] | None = None) -> int:
        """Go on with ``settings`` (and ``messages``, when given): a new cache fed the whole
        conversation. All or nothing: the settings are checked against the model, and the new
        cache is built and fed, before anything of the current conversation is dropped; a failure
        leaves the conversation exactly as it was. Returns the number of tokens fed."""
        settings.validate()
        check_fits(settings.cache, self.model)
        messages = self.messages if messages is None else [dict(m) for m in messages]
        cache = settings.cache.build(self.model)
        text = self.render(add_generation_prompt=False, messages=messages, settings=settings) if messages else ""
        ids = self.encode(text)
        if ids:
            with torch.inference_mode():
                prefill(self.model, cache, torch.tensor([ids], device=self.device), chunk=self.prefill_chunk)
        starts = self._turn_starts(text, messages)
        if messages is not self.messages:
            self.warned = set()
        self.settings, self.messages = settings, messages
        self._install(cache, ids, text, starts)
        return len(ids)

    # -- templates --------------------------------------------------------------------------------
    def chat_messages(self, messages: list[dict] | None = None, settings: ChatSettings | None = None) -> list[dict]:
        messages = self.messages if messages is None else messages
        system = (settings or self.settings).system
        return ([{"role": "system", "content": system}] if system else []) + [
            {"role": m["role"], "content": m["content"]} for m in messages]

    @property
    def plain_transcript(self) -> bool:
        """No chat template: the conversation is rendered as a 'User: / Assistant:' transcript."""
        return not has_chat_template(self.tokenizer)

    def render(self, add_generation_prompt: bool, messages: list[dict] | None = None,
               settings: ChatSettings | None = None) -> str:
        chat = self.chat_messages(messages, settings)
        if not self.plain_transcript:
            return self.tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        # base models: a plain transcript they can continue
        # "Assistant:" without a space: the model writes its own leading space, as after the prompt
        names = {"system": "", "user": "User: ", "assistant": "Assistant:"}
        text = "".join(f"{names.get(m['role'], m['role'] + ': ')}{m['content']}\n\n" for m in chat)
        return text + ("Assistant:" if add_generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        # the rendered template carries its own special tokens (BOS included when it wants one)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    # -- a turn -----------------------------------------------------------------------------------
    def send(self, user_text: str, on_piece: Callable[[str], None] | None = None,
             on_reading: Callable[[], None] | None = None) -> TurnResult:
        """Add a user message and generate the reply, streaming text pieces to ``on_piece``;
        ``on_reading`` is called between the prompt's chunks (a display showing ``prompt_reading``).

        Ends early, keeping the partial reply (marked interrupted), when ``stop_requested`` is set
        or KeyboardInterrupt is raised (by ``on_piece`` or a Ctrl-C handler), during the prompt's
        reading too (between its chunks). A failure leaves no trace of the turn in the messages.
        """
        settings = self.settings
        notices: list[str] = []
        timing, generated = Timing(), []
        self.current, self.stop_requested, interrupted = timing, False, False
        self._on_reading = on_reading
        self._hard_stop = False
        self.messages.append({"role": "user", "content": user_text})
        try:
            target = self.render(add_generation_prompt=True)
            if self.fed_text and target.startswith(self.fed_text):
                new_ids = self.pending + self.encode(target[len(self.fed_text):])
                self.turn_starts.append(len(self.ids) + len(self.pending))  # the pending token ends the last reply
            else:
                if self.ids and not self._quiet_refeed:
                    notices.append("feeding the whole conversation again into a fresh cache (its start changed "
                                   "or a reply was cut mid-step)")
                self._install(self.settings.cache.build(self.model), [], "", self._turn_starts(target))
                new_ids = self.encode(target)
            self._quiet_refeed = False
            base = len(self.ids)
            evicted_before = evicted_per_head(self.cache)
            context = (self.ids + new_ids)[-CONTEXT_IDS:]  # the reply's first word joins the prompt as it should
            pieces = TextStream(self.tokenizer, context=context)
            reply = ReplyText(STOP_MARK if self.plain_transcript else None, on_piece)
            if self._decode is None:
                self._decode = decoder(self.model, self.compile)
            steps = stream(self.model, self.cache, torch.tensor([new_ids], device=self.device),
                           max_new_tokens=settings.max_new_tokens, sampling=settings.sampling,
                           stop_ids=self.stop_ids, prefill_chunk=self.prefill_chunk, timing=timing,
                           decode=self._decode, stop_check_every=self.burst(),
                           should_stop=self._between_chunks)
            self.reading = (tokens_read(self.cache), len(new_ids), time.monotonic())
            try:
                for step in inference_steps(steps):
                    self.reading = None
                    generated.append(int(step.tokens[0]))
                    if reply.add(pieces.push(generated[-1])):
                        # a base model starts writing the user's part: the reply is over (the cache
                        # may have read on to the burst's end: the next turn reads it all again)
                        break
                    # a stop request ends the stream before its next decode step: the tokens of the
                    # burst read back with this one are the reply's, and the cache has read them
                    interrupted = interrupted or self.stop_requested
            except KeyboardInterrupt:
                interrupted = True
            stopped_reading = self.prompt_reading() if not generated else None
            reply.finish()
        except Exception:
            # a failed turn leaves no trace but forces the next one to start from a fresh cache
            self.messages.pop()
            self.fed_text = ""
            raise
        finally:
            self.current, self.reading, self._on_reading = None, None, None
        # The reply as the template will render it next turn: special tokens the model wrote inside
        # it stay, so the rendered history still starts with what the cache was fed. A final stop
        # token was never fed: drop it and let the template close the turn its own way.
        body = generated[:-1] if generated and generated[-1] in self.stop_ids else generated
        content = decode_in_context(self.tokenizer, context, body)
        self._account(base, new_ids + body, target + content)
        if reply.stopped:  # the cache read past the reply's end: the next turn reads it all again
            content = content[: content.find(STOP_MARK)] if STOP_MARK in content else reply.text
            self.fed_text, self._quiet_refeed = "", True
        message = {"role": "assistant", "content": content}
        if interrupted:
            message["interrupted"] = True
        self.messages.append(message)
        notices += self.eviction_notices()
        return TurnResult(reply.text, interrupted, timing, evicted_per_head(self.cache) - evicted_before, notices,
                          stopped_reading if interrupted else None)

    def _between_chunks(self) -> bool:
        """``stream``'s hook between prompt chunks (and decode steps): a display may refresh the
        reading's figures; True ends the turn (a Ctrl-C noted)."""
        if self.reading is not None and self._on_reading is not None:
            self._on_reading()
        return self.stop_requested

    def prompt_reading(self) -> tuple[int, int, float] | None:
        """(prompt tokens read, of how many, seconds since the reading began) while a prompt is read."""
        if self.reading is None:
            return None
        before, total, began = self.reading
        return min(max(tokens_read(self.cache) - before, 0), total), total, time.monotonic() - began

    def burst(self) -> int:
        """Tokens generated per read-back of the stop check this turn (see ``stop_check_every``)."""
        if not self.cache.masks_inactive_rows:
            return 1
        return self.stop_check_every if self.stop_check_every is not None else stop_check_interval(self.device)

    def _account(self, base: int, tokens: list[int], text: str) -> None:
        """Record what the cache now holds after feeding (part of) ``tokens`` on top of ``base``."""
        seen = {layer.tokens_fed_with_padding for layer in self.cache.layers if layer.is_initialized} or {base}
        fed = seen.pop() - base if len(seen) == 1 and not self._hard_stop else -1
        if not 0 <= fed <= len(tokens):
            # stopped in the middle of a forward (layers disagree), or the cache read on past the tokens
            # kept (the rest of a burst after a base model's "User:" or a Ctrl-C raised mid-burst):
            # start over at the next turn
            self.fed_text = ""
            return
        self.ids += tokens[:fed]
        self.pending = tokens[fed:]
        self.fed_text = text

    def _turn_starts(self, text: str, messages: list[dict] | None = None) -> list[int]:
        """Where each turn starts, in tokens, for a conversation fed whole as ``text``: the first
        after the system prompt and header, each later one where the messages before it end."""
        messages = self.messages if messages is None else messages
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            return []
        at = text.find(messages[users[0]]["content"])
        starts = [len(self.encode(text[:at])) if at > 0 else 0]
        return starts + [len(self.encode(self.render(add_generation_prompt=False, messages=messages[:i])))
                         for i in users[1:]]

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
        """Replace messages and settings with a saved conversation; returns tokens re-fed.
        All or nothing, as ``reconfigure``."""
        if not isinstance(data, dict) or data.get("format") != "h2ochat-conversation":
            raise UserError("not an h2ochat conversation file")
        messages = data.get("messages")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise UserError("the conversation file has no valid message list")
        return self.reconfigure(ChatSettings.from_json(data.get("settings") or {}), messages)


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
    # under nohup SIGHUP is ignored on purpose: the reply (and the session) must outlive the terminal
    watched = [number for number in watched if signal.getsignal(number) is not signal.SIG_IGN]
    previous = {number: signal.signal(number, handler if number == signal.SIGINT else hangup) for number in watched}
    try:
        yield
    finally:
        for number, action in previous.items():
            signal.signal(number, action)
