"""One request as the engine sees it: its prompt tokens, its choices, and the events it sends back.

A ``Choice`` is one sequence being generated (a request with ``n`` = 3 has three, each in its own
row): it holds its own settings, random stream and repetition window (``serve.sampling`` draws every
row's token of a step at once, on the logits' device), turns tokens into text,
applies stop tokens, stop strings and ``max_tokens``, and emits text as soon as no stop string can
still begin in it. Events go to the request's ``emit`` callback (the engine thread calls it; the
server hands each event over to the event loop):

    ("text", index, piece)      new text of choice ``index``
    ("finish", index, reason)   "stop" | "length" | "cancelled" (exactly once per choice)
    ("done", usage)             every choice finished; the usage record
    ("error", APIError)         the request failed; nothing follows
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine.detokenize import CONTEXT_IDS, TextStream
from ..engine.generation import Sampling
from ..engine.repetition import RecentTokens
from .api import RequestParams

_ids = itertools.count(1)


@dataclass
class Prepared:
    """What the server made of a request before the engine takes it: every token of the prompt
    (the whole conversation so far), the text they spell (None for a prompt given as token ids),
    and the generation limits."""

    params: RequestParams
    prompt_ids: list[int]
    prompt_text: str | None
    max_tokens: int
    sampling: Sampling  # the server's repetition settings with the request's temperature / top_p / seed


class Choice:
    """One generated sequence of a request."""

    def __init__(self, request: "Request", index: int, tokenizer, seed: int):
        self.request, self.index = request, index
        self.sampling = request.prepared.sampling
        self.seed = seed
        self.generator: torch.Generator | None = None  # made on the logits' device at the first draw
        self.seen: RecentTokens | None = None
        self._bias: torch.Tensor | None = None  # logit_bias as a [V] tensor on the logits' device
        self._counts: torch.Tensor | None = None  # [V] times each token was generated (for the penalties)
        self._counted = 0  # generated tokens already in _counts
        # seeded with the prompt's last ids, as the chat does: the first word joins the prompt as in the whole text
        self.text_stream = TextStream(tokenizer, context=request.prompt_ids[-CONTEXT_IDS:],
                                      skip_special_tokens=request.prepared.params.skip_special_tokens)
        self.tokenizer = tokenizer
        self.generated: list[int] = []
        self.held = ""  # decoded text not emitted yet: a stop string may begin in it
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.row: int | None = None
        self.evicted_at_start = 0  # the row's eviction count when this choice took it
        self.recalled_at_start = 0  # and its count of pages recalled (a recall tier; else 0)

    @property
    def last(self) -> int:
        return self.generated[-1]

    def place(self, row: int, evicted: int, recalled: int = 0) -> None:
        """This choice runs in batch row ``row``, whose counts of evicted tokens and recalled pages are
        ``evicted`` and ``recalled`` as it takes it."""
        self.row, self.evicted_at_start, self.recalled_at_start = row, evicted, recalled

    def move_to(self, row: int) -> None:
        """The scheduler moved this choice's cache to batch row ``row`` (the count moves with it)."""
        self.row = row

    # -- what the batch sampler asks (serve.sampling.SampledRow) ---------------------------------
    def generator_on(self, device: torch.device) -> torch.Generator:
        """This choice's random stream, made on ``device`` (the logits') at its first draw and seeded
        as the request says: on the CPU the same stream as a ``torch.Generator().manual_seed(seed)``."""
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def window_on(self, device: torch.device, vocab: int) -> RecentTokens:
        """The tokens the repetition penalty looks at, on ``device``: made at the first draw from the
        prompt tokens this request fed; the sampler pushes each token drawn."""
        if self.seen is None:
            fed = torch.tensor([self.request.fed_ids], dtype=torch.long, device=device)
            self.seen = RecentTokens(fed, None, vocab, self.sampling.repeat_last_n)
        return self.seen

    def logit_offsets_on(self, device: torch.device, vocab: int) -> torch.Tensor | None:
        """What this choice adds to its logits before sampling ([V] fp32 on ``device``): the request's
        logit_bias, minus OpenAI's frequency and presence penalties on the tokens generated so far;
        None when the request asks for none of them."""
        params = self.request.prepared.params
        penalised = params.frequency_penalty or params.presence_penalty
        if not params.logit_bias and not penalised:
            return None
        if self._bias is None:
            self._bias = torch.zeros(vocab, dtype=torch.float32, device=device)
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
                values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
                self._bias[ids] = values
        if not penalised:
            return self._bias
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        new = self.generated[self._counted:]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=device)
            self._counts.index_put_((ids,), torch.ones(len(new), device=device), accumulate=True)
            self._counted = len(self.generated)
        return (self._bias - params.frequency_penalty * self._counts
                - params.presence_penalty * (self._counts > 0).float())

    def push(self, token: int) -> str | None:
        """Take the next generated token; the finish reason when the choice is over (the caller
        then frees its row and calls ``finish``), else None."""
        self.generated.append(token)
        request = self.request
        if token in request.stop_ids:
            return "stop"
        self.held += self.text_stream.push(token)
        stops = request.prepared.params.stop
        if stops:
            found = [(self.held.find(s), s) for s in stops if s in self.held]
            if found:
                self.held = self.held[: min(found)[0]]
                self.stopped_by_string = True
                return "stop"
        keep = _longest_stop_prefix(self.held, stops)
        if len(self.held) > keep:
            self._emit_text(self.held[: len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
        if len(self.generated) >= request.prepared.max_tokens:
            return "length"
        return None

    def finish(self, reason: str) -> None:
        """Emit the held text (unless cancelled) and the finish reason, once. The text stream's own
        held-back ids (an incomplete character at the end) are decoded as they are, unless a stop
        string ended the text before them."""
        if self.finish_reason is None:
            if reason != "cancelled":
                if not self.stopped_by_string:
                    self.held += self.text_stream.text[len("".join(self.text_stream.pieces)):]
                self._emit_text(self.held)
            self.held = ""
            self.finish_reason = reason
            self.request.emit(("finish", self.index, reason))
            self.request.choice_finished()

    def _emit_text(self, piece: str) -> None:
        if piece:
            self.request.emit(("text", self.index, piece))

    # -- what the row's cache holds when this choice ends (for the parked store) ----------------
    def conversation(self) -> tuple[list[int], int, str | None]:
        """(tokens the conversation spells, how many of them the row's cache has seen, their text).

        The last generated token was never fed (nothing read its keys yet): the cache has seen the
        prompt and every generated token but the last. As in the chat REPL, a final stop token is
        left out of the conversation (the chat template closes the turn its own way next time); any
        other last token is kept, unfed, to be fed first when the conversation goes on."""
        fed = self.request.prompt_ids + self.generated[:-1]
        body = self.generated[:-1] if self.generated and self.generated[-1] in self.request.stop_ids else self.generated
        tokens = self.request.prompt_ids + body
        text = None
        if self.request.prepared.prompt_text is not None:  # (the text as the client got it: the history it sends back)
            text = self.request.prepared.prompt_text + self.tokenizer.decode(
                body, skip_special_tokens=self.text_stream.skip_special_tokens)
        return tokens, len(fed), text


def _longest_stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that is the start of a stop string (held back)."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if stop.startswith(text[-size:]):
                best = size
                break
    return best


@dataclass
class Request:
    """A request in the engine: its prepared prompt, its choices and where its events go."""

    prepared: Prepared
    emit: Callable[[tuple], None]
    stop_ids: frozenset[int]
    tokenizer: object = field(repr=False)
    id: str = field(default_factory=lambda: f"{next(_ids):x}{time.time_ns() % 10**9:x}")
    created: int = field(default_factory=lambda: int(time.time()))
    cached_tokens: int = 0  # prompt tokens read from a parked cache instead of being fed
    fed_ids: list[int] = field(default_factory=list)  # the prompt tokens this request fed
    evicted_tokens: int = 0
    recalled_pages: int = 0  # pages a recall tier brought back into its rows' slots (serve --recall)
    kv_slots: int = 0
    cancelled: bool = False
    choices: list[Choice] = field(default_factory=list)
    _open: int = 0

    def __post_init__(self):
        params = self.prepared.params
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, ()))
        # choice k draws from seed + k: choice 0 is what the same request with n = 1 gets
        self.choices = [Choice(self, index, self.tokenizer, base + index) for index in range(params.n)]
        self._open = params.n

    @property
    def n(self) -> int:
        return len(self.choices)

    @property
    def prompt_ids(self) -> list[int]:
        return self.prepared.prompt_ids

    @property
    def finished(self) -> bool:
        return self._open == 0

    def began(self, cached_tokens: int, fed_ids: list[int], kv_slots: int) -> None:
        """What its prefill starts from: prompt tokens taken from a parked cache, the ones it feeds, and
        the slots per layer and KV head each of its rows holds."""
        self.cached_tokens, self.fed_ids, self.kv_slots = cached_tokens, fed_ids, kv_slots

    def count_evicted(self, tokens: int, pages_recalled: int = 0) -> None:
        """Tokens its rows evicted and pages their recall tier brought back (per layer and KV head,
        summed), for ``usage``."""
        self.evicted_tokens += tokens
        self.recalled_pages += pages_recalled

    def cancel(self) -> None:
        self.cancelled = True

    def choice_finished(self) -> None:
        self._open -= 1
        if self._open == 0:
            self.emit(("done", self.usage()))

    def usage(self) -> dict:
        completion = sum(len(choice.generated) for choice in self.choices)
        prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            # what the cache did: slots per layer and KV head each sequence holds, and the tokens it
            # dropped for this request (per layer and KV head, summed over layers, heads and choices)
            "kv_slots": self.kv_slots,
            "evicted_tokens": self.evicted_tokens,
            "recalled_pages": self.recalled_pages,  # (pages of the recall tier's cold store; 0 without one)
        }

    def fail(self, error) -> None:
        for choice in self.choices:
            choice.finish_reason = choice.finish_reason or "error"
        self._open = 0
        self.emit(("error", error))
