"""Continuous batching over a fixed set of N rows, with chunked prefill of newcomers.

Every ``step`` runs at most one prefill chunk of the request being admitted, then one decode step
of all N rows (free rows are fed a dummy token and their output ignored: the batch keeps its shape,
which is what lets ``--compile`` capture the step once). A newcomer is prefilled on a cache of its
own, chunk by chunk between the others' decode steps, and moved into free rows when its prompt is
read, so it never stalls the batch for more than one chunk. A row is recycled the step after its
choice finishes, hits a stop or is cancelled: its cache is parked and the row reset. Rows never grow,
so nothing is ever preempted.

The model sits behind ``Backend``; the scheduler only decides what runs when, so it is tested with
a fake model. It runs on the engine thread only.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from .errors import APIError, server_error
from .sequence import Choice, Request


class Backend(Protocol):
    rows: int

    def begin(self, request: Request) -> object:
        """Start admitting ``request``: a prefill job (resuming a parked cache when one matches;
        sets ``request.cached_tokens`` and ``request.fed_ids``)."""

    def prefill(self, job) -> torch.Tensor | None:
        """Feed the job's next prompt chunk; the next-token logits [V] once the prompt is read."""

    def install(self, job, rows: list[int]) -> None:
        """Copy the job's cache into each of ``rows`` (one per choice)."""

    def abort(self, job) -> None:
        """Drop a job whose request went away before it had rows."""

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row (all N); the next-token logits [N, V]."""

    def release(self, row: int, choice: Choice | None) -> None:
        """Free ``row``: park its cache as ``choice``'s conversation (None: do not park), reset it."""

    def decoded(self, free_rows: list[int]) -> None:
        """After a decode step: ``free_rows`` were fed a dummy token."""

    def evicted(self, row: int) -> int:
        """Tokens evicted so far in ``row`` (per layer and KV head, summed)."""


DUMMY_TOKEN = 0  # what a free row is fed (its output is ignored and its cache reset before reuse)


class Scheduler:
    def __init__(self, backend: Backend):
        self.backend = backend
        self.rows: list[Choice | None] = [None] * backend.rows
        self.waiting: deque[Request] = deque()
        self.job = None  # the prefill job of the request being admitted
        self.admitting: Request | None = None

    # -- what the engine asks ------------------------------------------------------------------
    @property
    def running(self) -> int:
        """Requests holding rows."""
        return len({id(choice.request) for choice in self.rows if choice is not None})

    @property
    def rows_in_use(self) -> int:
        return sum(choice is not None for choice in self.rows)

    @property
    def free_rows(self) -> list[int]:
        return [row for row, choice in enumerate(self.rows) if choice is None]

    @property
    def idle(self) -> bool:
        return self.job is None and not self.waiting and self.rows_in_use == 0

    def submit(self, request: Request) -> None:
        if request.n > len(self.rows):
            raise ValueError(f"n = {request.n} is more than the server's {len(self.rows)} rows")
        self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """End ``request`` now: a waiting one leaves the queue, an admitted one drops its prefill,
        a running one frees its rows (parking what they hold)."""
        request.cancelled = True
        if request in self.waiting:
            self.waiting.remove(request)
        if request is self.admitting:
            self.backend.abort(self.job)
            self.job = self.admitting = None
        for row, choice in enumerate(self.rows):
            if choice is not None and choice.request is request:
                self._free(row, park=True)
        for choice in request.choices:
            choice.finish("cancelled")

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> bool:
        """At most one prefill chunk, then one decode step of the rows; False when there was nothing to do."""
        worked = self._prefill_step()
        if self.rows_in_use:
            self._decode_step()
            worked = True
        return worked

    def _prefill_step(self) -> bool:
        if self.job is None and self.waiting and len(self.free_rows) >= self.waiting[0].n:
            request = self.waiting.popleft()
            try:
                self.job = self.backend.begin(request)
            except Exception as exc:  # noqa: BLE001  one request's failure must not stop the engine
                request.fail(_as_api_error(exc))
                return True
            self.admitting = request
        if self.job is None:
            return False
        request = self.admitting
        try:
            logits = self.backend.prefill(self.job)
            if logits is None:
                return True
            rows = self.free_rows[: request.n]
            self.backend.install(self.job, rows)
        except Exception as exc:  # noqa: BLE001
            self.backend.abort(self.job)
            self.job = self.admitting = None
            request.fail(_as_api_error(exc))
            return True
        self.job = self.admitting = None
        for row, choice in zip(rows, request.choices):
            choice.row = row
            choice.evicted_at_start = self.backend.evicted(row)
            self.rows[row] = choice
        for row, choice in zip(rows, request.choices):
            self._advance(row, choice, logits)
        return True

    def _decode_step(self) -> None:
        tokens = [choice.last if choice is not None else DUMMY_TOKEN for choice in self.rows]
        free = self.free_rows
        try:
            logits = self.backend.decode(tokens)
            self.backend.decoded(free)
        except Exception as exc:  # noqa: BLE001  the batch's state is unknown: fail its requests, free every row
            error = _as_api_error(exc)
            for row, choice in enumerate(self.rows):
                if choice is not None:
                    self._free(row, park=False)
                    if choice.finish_reason is None:
                        choice.request.fail(error)
            return
        for row, choice in enumerate(self.rows):
            if choice is not None:
                self._advance(row, choice, logits[row])

    def _advance(self, row: int, choice: Choice, logits: torch.Tensor) -> None:
        """Sample the row's next token; a choice that is over frees its row first (so the usage
        counts its evictions) and then says so."""
        reason = choice.push(choice.sample(logits))
        if reason is not None:
            self._free(row, park=True)
            choice.finish(reason)

    def _free(self, row: int, *, park: bool) -> None:
        choice = self.rows[row]
        self.rows[row] = None
        if choice is None:
            return
        choice.request.evicted_tokens += self.backend.evicted(row) - choice.evicted_at_start
        self.backend.release(row, choice if park else None)

    def fail_all(self, error: APIError) -> None:
        """The engine is stopping or broken: every request in it fails."""
        requests = list(self.waiting) + ([self.admitting] if self.admitting else [])
        requests += [choice.request for choice in self.rows if choice is not None]
        self.waiting.clear()
        if self.job is not None:
            self.backend.abort(self.job)
        self.job = self.admitting = None
        for row in range(len(self.rows)):
            self._free(row, park=False)
        for request in dict.fromkeys(requests):
            if not request.finished:
                request.fail(error)


def _as_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    return server_error(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "))
