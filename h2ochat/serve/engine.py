"""The engine thread: it alone touches the model and the caches.

Request handlers (on the event loop) hand requests over through a thread-safe inbox and get their
events back through ``emit`` (which the server points at ``loop.call_soon_threadsafe``), so the
event loop never waits for the model. The thread loads the model first (``/health`` says 503 until
then), then runs scheduler steps while there is work and sleeps on the inbox when there is none.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from .errors import APIError, queue_full, server_error, shutting_down
from .metrics import Metrics, request_line
from .parked import ParkedStore
from .prepare import Preparer
from .scheduler import Scheduler
from .sequence import Prepared, Request

TIER_GAUGE_PERIOD_S = 1.0  # the tier's /metrics figures are read at most this often (a sum over layers)
log = logging.getLogger("h2ochat.serve")
request_log = logging.getLogger("h2ochat.serve.requests")  # one line per request (`serve --quiet`: off)


@dataclass
class Loaded:
    """What the engine's load function returns."""

    backend: object  # a scheduler Backend
    tokenizer: object
    preparer: Preparer
    stop_ids: frozenset[int]
    model_id: str
    row_bytes: int = 0
    layers: int = 0
    kv_heads: int = 0
    prefill_chunks: int = 1  # prompt chunks a scheduler step may read (``Scheduler``)


class Engine:
    def __init__(self, load: Callable[[], Loaded], *, store: ParkedStore, metrics: Metrics, max_queue: int,
                 retry_after_s: int = 1):
        self._load = load
        self.store, self.metrics = store, metrics
        self.max_queue, self.retry_after_s = max_queue, retry_after_s
        self.loaded: Loaded | None = None
        self.load_error: str | None = None
        self.load_exception: BaseException | None = None  # what loading raised, for the command to report
        self.load_finished = threading.Event()
        self.scheduler: Scheduler | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = False  # stop() was called: submit refuses
        self._submitted = 0  # handed over, not yet taken from the inbox
        self._queued = 0  # waiting or being prefilled (the engine's count after its last step)
        self._gauges: dict[str, tuple[str, float]] = {}
        self._tier_gauges: dict[str, tuple[str, float]] = {}
        self._tier_read = -TIER_GAUGE_PERIOD_S  # when the tier's figures were last read (they read the device)
        self._thread = threading.Thread(target=self._run, name="h2ochat-engine", daemon=True)
        metrics.read_gauges(lambda: dict(self._gauges))

    # -- from the event loop -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.loaded is not None

    def submit(self, prepared: Prepared, emit: Callable[[tuple], None]) -> Request:
        """Hand a request to the engine; a full queue raises the 429 ``APIError``."""
        loaded = self.loaded
        stop_ids = frozenset() if prepared.params.ignore_eos else loaded.stop_ids
        started = time.monotonic()
        request = Request(prepared, emit=lambda event: self._account(request, event, emit, started),
                          stop_ids=stop_ids, tokenizer=loaded.tokenizer)
        with self._lock:
            if self._stopping:
                raise shutting_down()
            if self._submitted + self._queued >= self.max_queue:
                raise queue_full(self.retry_after_s)
            self._submitted += 1
            self._inbox.put(("submit", request))  # under the lock: never behind the stop message, never lost
        return request

    def cancel(self, request: Request) -> None:
        self._inbox.put(("cancel", request))

    def stop(self, timeout: float = 10.0) -> bool:
        """Fail every request in the engine (their streams end with an error event) and end the thread;
        True once it has ended, False if it is still loading or in a step after ``timeout`` (0: do not wait)."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- accounting (engine thread) --------------------------------------------------------------------
    def _account(self, request: Request, event: tuple, emit: Callable[[tuple], None], started: float) -> None:
        kind = event[0]
        if kind == "done":
            usage = event[1]
            self.metrics.add("prompt_tokens_total", usage["prompt_tokens"])
            self.metrics.add("prompt_tokens_cached_total", usage["prompt_tokens_details"]["cached_tokens"])
            self.metrics.add("generation_tokens_total", usage["completion_tokens"])
            self.metrics.add("evicted_tokens_total", usage["evicted_tokens"])
            if usage["prompt_tokens_details"]["cached_tokens"]:
                self.metrics.add("parked_resumed_total")
            self.metrics.finished(request.choices[0].finish_reason or "stop")
            request_log.info(request_line(request, time.monotonic() - started))
        elif kind == "error":
            self.metrics.finished("error")
            request_log.warning(request_line(request, time.monotonic() - started, error=event[1].message))
        emit(event)

    # -- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.loaded = self._load()
        except Exception as exc:  # noqa: BLE001  reported by /health, and by the command, which then stops
            self.load_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.load_exception = exc
            return
        finally:
            self.load_finished.set()
        self.scheduler = Scheduler(self.loaded.backend, self.loaded.prefill_chunks)
        self._update_gauges()
        while True:
            if not self._drain(block=self.scheduler.idle):
                self.scheduler.fail_all(shutting_down())
                return
            try:
                self.scheduler.step()
            except Exception:  # noqa: BLE001  a bug: fail what is running, keep serving
                log.error("engine step failed:\n%s", traceback.format_exc())
                self.scheduler.fail_all(server_error("internal error in the engine (see the server log)"))
            self._update_gauges()

    def _drain(self, block: bool) -> bool:
        """Take every message waiting (blocking for the first when idle); False on stop."""
        while True:
            try:
                kind, request = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "submit":
                with self._lock:
                    self._submitted -= 1
                    self._queued += 1
                if request.cancelled:
                    continue
                try:
                    self.scheduler.submit(request)
                except ValueError as exc:
                    request.fail(APIError(400, str(exc), param="n"))
            elif kind == "cancel" and not request.finished:
                self.scheduler.cancel(request)
            self._update_gauges()

    def _update_gauges(self) -> None:
        scheduler, loaded = self.scheduler, self.loaded
        running = [choice for choice in scheduler.rows if choice is not None]
        slots = getattr(loaded.backend, "slots", 0)
        held = sum(min(len(c.request.prompt_ids) + len(c.generated) - 1, slots) for c in running)
        waiting = len(scheduler.waiting) + (scheduler.admitting is not None)
        with self._lock:
            self._queued = waiting
        rows = len(scheduler.rows)
        per_head = loaded.layers * loaded.kv_heads
        tier_gauges = getattr(loaded.backend, "tier_gauges", None)
        if tier_gauges is not None and time.monotonic() - self._tier_read >= TIER_GAUGE_PERIOD_S:
            self._tier_gauges, self._tier_read = tier_gauges(), time.monotonic()
        self._gauges = {
            "requests_running": ("Requests holding rows.", scheduler.running),
            "requests_waiting": ("Requests waiting for rows or being prefilled.", waiting),
            "rows": ("Sequence rows of the batch (--max-sequences).", rows),
            "rows_in_use": ("Rows holding a running sequence.", len(running)),
            "kv_slots_per_row": ("KV slots per layer and KV head of one row (the budget).", slots),
            "kv_slots_in_use": ("KV slots holding a token in the rows in use (over layers and KV heads).",
                                held * per_head),
            "kv_bytes_in_use": ("Bytes of the rows in use (K, V and bookkeeping).", len(running) * loaded.row_bytes),
            "kv_bytes_reserved": ("Bytes of all rows of the batch cache.", rows * loaded.row_bytes),
            "kv_bytes_per_slot": ("Device KV bytes one slot takes in every layer of a row, over its KV heads (keys, "
                                  "values and their scales at --kv-dtype).", _slot_bytes(loaded.backend)),
            "parked_conversations": ("Conversation caches parked (in host memory, or resting in a free row).",
                                     len(self.store)),
            "parked_in_rows": ("Of those, the ones resting in the free row that ran them (not copied out: no bytes "
                               "of their own).", self.store.resting),
            "parked_bytes": ("Host bytes of parked conversation caches (those copied out of their rows).",
                             self.store.nbytes),
            "parked_bytes_limit": ("Bytes the parked caches may take (--parked-bytes).", self.store.capacity),
            **self._tier_gauges,
        }


def _slot_bytes(backend) -> int:
    """The batch cache's bytes per slot (``H2OCache.kv_bytes_per_slot``; 0 for a backend without one)."""
    cache = getattr(backend, "cache", None)
    return (cache.kv_bytes_per_slot() or 0) if cache is not None else 0
