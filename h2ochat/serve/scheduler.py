"""Continuous batching over a fixed set of N rows, with chunked prefill of newcomers.

Every ``step`` runs at most one prefill chunk of the request being admitted, then one decode step
of the rows in use. Rows in use are kept at the front (a row freed below others is filled by moving
the highest one down, only when that lets the step run fewer rows): the backend runs the smallest
of its bucket sizes (1, 2, 4, ... N rows) that holds them and leaves the free rows among them out of
the step, so one chat on a large server costs what it costs on a 1-row server (``--compile``'s graphs:
``engine.compiled``). A newcomer is prefilled on a cache of its own, chunk by chunk between
the others' decode steps (or, where the backend mixes them, in the same forward as a decode step), and
moved into free rows when its prompt is read, so it never stalls the batch for more than one chunk.
A row is recycled the step after its choice finishes, hits a stop or is cancelled: its cache is parked
and the row reset. Rows never grow, so nothing is ever preempted.

Every step's tokens are sampled in one call (``serve.sampling``); a request whose sampling or text
fails fails alone, the others go on. The model sits behind ``Backend``; the scheduler only decides
what runs when, so it is tested with a fake model. It runs on the engine thread only.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from .errors import APIError, server_error
from .sampling import sample_rows
from .sequence import Choice, Request


class Backend(Protocol):
    rows: int

    def begin(self, request: Request) -> object:
        """Start admitting ``request``: a prefill job (resuming a parked cache when one matches;
        sets ``request.cached_tokens`` and ``request.fed_ids``)."""

    def prefill(self, job) -> torch.Tensor | None:
        """Feed the job's next prompt chunk; the next-token logits [V] once the prompt is read."""

    def placement(self, job, free: list[int], count: int) -> list[int]:
        """Which ``count`` of the ``free`` rows the job's cache goes into (the cheapest to write)."""

    def install(self, job, rows: list[int]) -> None:
        """Copy the job's cache into each of ``rows`` (one per choice)."""

    def abort(self, job) -> None:
        """Drop a job whose request went away before it had rows."""

    def decode(self, tokens: list[int | None]) -> torch.Tensor:
        """Feed each row in use its token (``tokens[row]``; None: a free row, left out of the step);
        the next-token logits [R, V] of rows 0..R-1, R above the highest row in use."""

    def bucket(self, rows: int) -> int:
        """How many rows a decode step runs when rows 0..rows-1 are in use."""

    def move(self, source: int, target: int) -> None:
        """Move row ``source``'s cache into the free row ``target``; ``source`` is free after."""

    def release(self, row: int, choice: Choice | None) -> None:
        """Free ``row``: park its cache as ``choice``'s conversation (None: do not park), reset it."""

    def evicted(self, row: int) -> int:
        """Tokens evicted so far in ``row`` (per layer and KV head, summed)."""

    def recalled(self, row: int) -> int:
        """Pages a recall tier brought back into ``row`` so far (per layer and KV head, summed; 0 without)."""

    def mixes(self, job) -> bool:
        """Whether the job's next chunk and the next decode step run as one forward (``mixed``)."""

    def mixed(self, job, tokens: list[int | None]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``prefill`` of the job's next chunk and ``decode`` of ``tokens`` in one forward: the prompt's
        next-token logits [V] once it is read (else None), and the decode step's [R, V]."""


class Scheduler:
    """``prefill_chunks``: prompt chunks a step may read before its decode step (one request after
    another when one is read and the next waiting one fits the free rows). More make a step longer
    (the running rows wait for them) and newcomers join sooner, so decode steps run more rows."""

    def __init__(self, backend: Backend, prefill_chunks: int = 1):
        if prefill_chunks < 1:
            raise ValueError(f"prefill_chunks must be at least 1, got {prefill_chunks}")
        self.backend, self.prefill_chunks = backend, prefill_chunks
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
        request.cancel()
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
        """At most ``prefill_chunks`` prefill chunks, then one decode step of the rows; the last chunk
        and the decode step run as one forward where the backend mixes them (``Backend.mixes``).
        False when there was nothing to do."""
        worked = False
        for chunk in range(self.prefill_chunks):
            if chunk == self.prefill_chunks - 1 and self._mixes():
                self._mixed_step()
                return True
            if not self._prefill_step():
                break
            worked = True
        if self.rows_in_use:
            self._decode_step()
            worked = True
        return worked

    def _admit(self) -> bool:
        """Begin admitting the first waiting request when none is being admitted and its choices fit
        the free rows; False when beginning it failed (the request fails)."""
        if self.job is None and self.waiting and len(self.free_rows) >= self.waiting[0].n:
            request = self.waiting.popleft()
            try:
                self.job = self.backend.begin(request)
            except Exception as exc:  # noqa: BLE001  one request's failure must not stop the engine
                request.fail(_as_api_error(exc))
                return False
            self.admitting = request
        return True

    def _mixes(self) -> bool:
        """Whether this step's prompt chunk runs in one forward with the decode step."""
        if not self.rows_in_use or not self._admit():
            return False
        return self.job is not None and self.backend.mixes(self.job)

    def _prefill_step(self) -> bool:
        if not self._admit():
            return True
        if self.job is None:
            return False
        try:
            logits = self.backend.prefill(self.job)
        except Exception as exc:  # noqa: BLE001
            self._drop_job(exc)
            return True
        if logits is not None:
            self._install(logits)
        return True

    def _install(self, logits: torch.Tensor) -> None:
        """The admitted request's prompt is read (``logits`` [V]: its next token's): its cache goes
        into free rows, one per choice, and each samples its first token."""
        request = self.admitting
        try:
            rows = self.backend.placement(self.job, self.free_rows, request.n)
            self.backend.install(self.job, rows)
        except Exception as exc:  # noqa: BLE001
            self._drop_job(exc)
            return
        self.job = self.admitting = None
        for row, choice in zip(rows, request.choices):
            choice.place(row, self.backend.evicted(row), self.backend.recalled(row))
            self.rows[row] = choice
        self._advance(list(zip(rows, request.choices)), logits.unsqueeze(0).expand(len(rows), -1))

    def _drop_job(self, exc: Exception) -> None:
        """The admitted request fails (its prompt could not be read or installed); its job goes."""
        request = self.admitting
        self.backend.abort(self.job)
        self.job = self.admitting = None
        request.fail(_as_api_error(exc))

    def _decode_step(self) -> None:
        self._pack()
        try:
            logits = self.backend.decode(self._tokens())
        except Exception as exc:  # noqa: BLE001  the batch's state is unknown: fail its requests, free every row
            self._fail_batch(_as_api_error(exc))
            return
        self._advance_rows(logits)

    def _mixed_step(self) -> None:
        """The admitted request's next chunk and the decode step of the rows, in one forward; when it
        fails, the request and the batch fail (neither cache's state is known)."""
        self._pack()
        try:
            prompt_logits, logits = self.backend.mixed(self.job, self._tokens())
        except Exception as exc:  # noqa: BLE001
            self._fail_batch(_as_api_error(exc))
            self._drop_job(exc)
            return
        self._advance_rows(logits)
        if prompt_logits is not None:
            self._install(prompt_logits)

    def _tokens(self) -> list[int | None]:
        """What each row feeds its next decode step (None: a free row)."""
        return [choice.last if choice is not None else None for choice in self.rows]

    def _fail_batch(self, error: APIError) -> None:
        """Every row's request fails and every row is freed (nothing parked)."""
        for row, choice in enumerate(self.rows):
            if choice is not None:
                self._free(row, park=False)
                if choice.finish_reason is None:
                    choice.request.fail(error)

    def _advance_rows(self, logits: torch.Tensor) -> None:
        """Sample the rows in use from a decode step's ``logits`` (rows 0..R-1 of the bucket)."""
        running = [(row, choice) for row, choice in enumerate(self.rows) if choice is not None]
        in_use = [row for row, _ in running]
        if in_use != list(range(len(in_use))):  # (packed rows need no gather)
            logits = logits.index_select(0, torch.tensor(in_use, device=logits.device))
        self._advance(running, logits[: len(in_use)])

    def _pack(self) -> None:
        """Move the highest rows in use down into free rows when the rows in use would then fit a
        smaller bucket (a decode step runs rows 0..bucket-1): a move copies one row's cache."""
        in_use = [row for row, choice in enumerate(self.rows) if choice is not None]
        if not in_use:
            return
        size = self.backend.bucket(len(in_use))
        if in_use[-1] < size:
            return
        targets = [row for row in self.free_rows if row < size]
        for source, target in zip(reversed([row for row in in_use if row >= size]), targets):
            choice = self.rows[source]
            if choice is None:  # (its request failed on an earlier move)
                continue
            try:
                self.backend.move(source, target)
            except Exception as exc:  # noqa: BLE001  both rows' state is unknown: its request fails, both are reset
                self._fail(choice.request, _as_api_error(exc))
                self.backend.release(target, None)
                continue
            self.rows[source], self.rows[target] = None, choice
            choice.move_to(target)

    def _advance(self, running: list[tuple[int, Choice]], logits: torch.Tensor) -> None:
        """Sample every running row's next token (``logits`` [R, V], one per entry of ``running``) in
        one call; a choice that is over frees its row first (so the usage counts its evictions) and
        then says so. A request whose sampling or text fails fails alone."""
        tokens = sample_rows(logits, [choice for _, choice in running])
        for (row, choice), token in zip(running, tokens):
            if self.rows[row] is not choice:  # its request failed on an earlier row of this step
                continue
            try:
                if isinstance(token, Exception):
                    raise token
                reason = choice.push(token)
            except Exception as exc:  # noqa: BLE001  one request's failure must not stop the others
                self._fail(choice.request, _as_api_error(exc))
                continue
            if reason is not None:
                self._free(row, park=True)
                choice.finish(reason)

    def _fail(self, request: Request, error: APIError) -> None:
        """``request`` fails: every row it holds is freed (nothing parked)."""
        for row, choice in enumerate(self.rows):
            if choice is not None and choice.request is request:
                self._free(row, park=False)
        if not request.finished:
            request.fail(error)

    def _free(self, row: int, *, park: bool) -> None:
        choice = self.rows[row]
        self.rows[row] = None
        if choice is None:
            return
        choice.request.count_evicted(self.backend.evicted(row) - choice.evicted_at_start,
                                     self.backend.recalled(row) - choice.recalled_at_start)
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
        for request in requests:  # (a Request is a dataclass, unhashable; one of n rows fails it for all)
            if not request.finished:
                request.fail(error)


def _as_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    return server_error(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "))
