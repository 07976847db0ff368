"""The server's rows: one ``H2OCache`` of N rows, the buckets a decode step may run, and the parked
conversations rows come from and go back to. It decides which cache a step or a prefill runs on; the
model runner (``serve.runner``) runs it.

The batch cache has static shapes. A decode step runs the smallest bucket of rows (1, 2, 4, ... N)
that holds the rows in use (the scheduler keeps them at the front, ``move``): each bucket is a cache
over the first rows of the batch cache, sharing its slots (views, so nothing is copied, and a
compiled step serves every bucket from two graphs on a CPU, one for one row and a dynamic one for more, or
captures one per bucket on CUDA, as vLLM captures one per batch size), and the free rows
inside it are left out of the step by the cache's ``active`` mask. A newcomer's prompt is read into
a 1-row cache of the same settings (resumed from a parked conversation when one matches), then
copied into free rows with ``H2OCache.import_row``.

A row that ends rests: where free rows are left out of the steps (they write nothing), its conversation
is parked as the row itself (``Parked.row``), nothing copied and nothing reset. The copy out to host
memory happens only when another conversation needs that row (``_vacate``): a chat whose next turn
comes while its row rests is read from the row, and goes back into it (``placement``), so a turn costs
no copy out, no emptying of the row and no page faults refilling it (a recall row's cold store is tens
of MB: these were most of a turn's ~74 ms of row moves on SmolLM2). Where free rows are stepped (a cache
that cannot leave rows out), a row that ends is copied out and reset as before.

A recall cache's buckets share its tiers (``TierSpec.row_prefixes``: a tier takes a step of its first
rows, the others left out), so it runs the smallest bucket too. A cache that cannot leave rows out of a
step (``masks_inactive_rows`` False) runs all N rows every step: free rows are fed a placeholder token
(their output is ignored) and reset before their positions could reach the model's limit.

The full policy never evicts: each row reserves its slots up front and a conversation longer than
that is refused (the preparer), as llama.cpp's server divides its context among its slots. Its
caches keep their columns (``H2OCache.keep_columns``): a growing cache would size itself by a count
of the batch's steps, not by what a row holds.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

from ..kv import H2OCache
from ..kv.tier import pages_recalled
from .parked import Parked, ParkedStore
from .sequence import Choice


def bucket_sizes(rows: int) -> list[int]:
    """1, 2, 4, ... below ``rows``, then ``rows``."""
    sizes = [1 << power for power in range(max(rows - 1, 0).bit_length())]
    return [size for size in sizes if size < rows] + [rows]


class RowPool:
    """``rows`` rows of caches made by ``new_cache(batch, static_shapes=...)`` (allocated, on the device)."""

    def __init__(self, new_cache: Callable[..., H2OCache], rows: int, *, store: ParkedStore, device,
                 max_positions: int, static_shapes: bool, buckets: Sequence[int] | None = None):
        self._new_cache, self.rows, self.store, self.device = new_cache, rows, store, device
        self.cache = new_cache(rows, static_shapes=static_shapes)
        self.masks_rows = self.cache.masks_inactive_rows
        # rows a decode step may run, and the caches over the first rows of the batch cache for each,
        # made now: each is allocated before its slots become views (smallest first, so the memory
        # taken at once is the batch cache's and half of it at most), not while requests run
        self.buckets = sorted(set(buckets)) if buckets else bucket_sizes(rows)
        if not self.cache.row_prefixes or self.buckets[-1] != rows:  # (a tier that steps every row: one bucket)
            self.buckets = [rows]
        self._prefixes: dict[int, H2OCache] = {rows: self.cache}
        for size in self.buckets[:-1]:
            self._prefixes[size] = self.cache.prefix(size)
        self.steps_by_rows: dict[int, int] = {}  # decode steps run per bucket size
        # a cache that cannot leave rows out feeds its free rows a placeholder: reset one before its
        # positions could reach the model's limit, and before it fills its slots (then a placeholder
        # would be evicted, into the cold store of a recall tier: a free row keeps its tier empty)
        self.free_steps = [0] * rows
        self.free_step_limit = max(1, min(max_positions // 2, *(layer.capacity // 2 for layer in self.cache.layers)))
        self.resting: dict[int, Parked] = {}  # free rows holding a parked conversation (not copied out)
        self.homes: set[int] = set()  # free rows holding a copy of a conversation being prefilled again
        self._spare: H2OCache | None = None  # the last prompt's 1-row cache, its memory still in place

    def new_cache(self, batch: int, *, static_shapes: bool) -> H2OCache:
        return self._new_cache(batch, static_shapes=static_shapes)

    def row_bytes(self) -> int:
        """Device bytes one row holds (keys, values and their bookkeeping)."""
        return (self.cache.kv_bytes() + self.cache.bookkeeping_bytes()) // self.rows

    # -- admission: a 1-row cache for the prompt, then into rows ------------------------------------
    def prefill_cache(self, ids: Sequence[int]) -> tuple[H2OCache, Parked | None, int | None]:
        """A 1-row cache to read a prompt into: the parked conversation ``ids`` extends, when one does
        (taken from the store; its state read in place from the row it rests in), else empty; and that
        row (its ``home``, where ``install`` puts it back), else None. The REPL's own kind (no static
        shapes): the prompt is read exactly as a chat reads it."""
        parked = self.store.take(ids)
        # a resumed conversation is imported over the last prompt's cache (an import into a 1-row cache
        # replaces every tensor and host counter of it), which saves a new cache and its page faults: with
        # recall, 38 -> 14 ms of a turn on SmolLM2 (a 30 MB row); a new one is read into a cache made for it
        spare, self._spare = self._spare, None
        cache = spare if parked is not None and spare is not None else self.new_cache(1, static_shapes=False)
        home = None
        if parked is not None:
            state = parked.state
            if parked.row is not None:
                home = parked.row
                self.resting.pop(home, None)
                self.homes.add(home)
                state = self.cache.export_row(home, copy=False)  # (views: read now, before any step)
            cache.import_row(0, state)
        return cache, parked, home

    def placement(self, free: Sequence[int], count: int, home: int | None = None) -> list[int]:
        """``count`` of the ``free`` rows for a conversation whose copy rests in ``home`` (None: none):
        ``home`` first, then rows holding nothing, then rows resting a parked conversation, the longest
        resting first (each is copied out before it is written). Among the rows a decode step of the
        rows then in use would run (the smallest bucket), so no row has to be moved down after."""
        in_use = self.rows - len(free)
        within = [row for row in free if row < self.bucket(in_use + count)] or list(free)
        rested = {row: rank for rank, row in enumerate(self.resting)}  # (in the order they began to rest)
        chosen = sorted(within, key=lambda row: (row != home, row in rested, rested.get(row, 0), row))[:count]
        return chosen + [row for row in free if row not in chosen][: count - len(chosen)]

    def install(self, source: H2OCache, rows: list[int], home: int | None = None) -> None:
        """Copy row 0 of ``source`` into each of ``rows`` (read in place; ``source`` is kept, memory and all,
        for the next resumed prompt); ``home``, the row its parked copy came from, is emptied when none of
        ``rows`` is it."""
        state = source.export_row(0, copy=False)
        for row in rows:
            self._vacate(row)
            self.cache.import_row(row, state)
            self.free_steps[row] = 0
        self.forget_home(home, reset=home not in rows)
        self._spare = source

    def forget_home(self, home: int | None, *, reset: bool = True) -> None:
        """The prefill that read its parked copy from row ``home`` ended (installed or dropped): the row
        is emptied unless it was written again (``reset`` False)."""
        if home is None or home not in self.homes:
            return
        self.homes.discard(home)
        if reset:
            self.cache.reset_rows([home])

    def _vacate(self, row: int) -> None:
        """Before ``row`` is written by another conversation: the one resting in it goes to host memory
        (still parked, now counted in bytes) and the row is emptied (its pages given back, a recall tier's
        stores fitted to the rows left: what a row that ended did before resting); a row holding a copy
        being prefilled again is simply taken (its conversation is in the prefill's cache)."""
        self.homes.discard(row)
        entry = self.resting.pop(row, None)
        if entry is None:
            return
        if self.store.holds(entry):
            state = self.cache.export_row(row, device="cpu")
            self.store.settle(entry, state, state.nbytes)
        self.cache.reset_rows([row])

    def move(self, source: int, target: int) -> None:
        """Row ``source``'s cache into the free row ``target`` (on the device), ``source`` reset."""
        self._vacate(target)
        self.cache.move_row(source, target)
        self.free_steps[target] = self.free_steps[source] = 0

    def release(self, row: int, choice: Choice | None) -> None:
        """Park ``row`` as ``choice``'s conversation (None: do not park): resting in the row where free rows
        are left out of the steps, else copied out; a row not resting is reset."""
        self.free_steps[row] = 0
        if choice is not None:
            tokens, fed, text = choice.conversation()
            if self.masks_rows:
                entry = Parked(tuple(tokens), fed, text, None, 0, row=row)
                if self.store.park(entry):
                    self.resting[row] = entry
                    return
            else:
                state = self.cache.export_row(row, device="cpu")
                self.store.park(Parked(tuple(tokens), fed, text, state, state.nbytes))
        self.cache.reset_rows([row])

    def parked_state(self, entry: Parked):
        """A parked conversation's state: its host copy, or views of the row it rests in."""
        return entry.state if entry.row is None else self.cache.export_row(entry.row, copy=False)

    # -- decode steps --------------------------------------------------------------------------------
    def bucket(self, rows: int) -> int:
        """The rows a decode step runs when rows 0..rows-1 are in use: the smallest bucket holding them."""
        return next(size for size in self.buckets if size >= rows)

    @contextlib.contextmanager
    def bucket_cache(self, size: int):
        """The cache over rows 0..size-1 for one decode step. A bucket's view and the batch cache hold
        the same rows and share one host-counter object (``kv.host_counters``): nothing is handed over."""
        cache = self._prefixes[size]
        self.steps_by_rows[size] = self.steps_by_rows.get(size, 0) + 1
        yield cache

    @contextlib.contextmanager
    def counters_kept(self):
        """Steps that write nothing (every row left out: the warm-up): the host counters are put back."""
        before = self.cache.host_counters()
        try:
            yield
        finally:
            self.cache.restore_host_counters(before)

    def stepped_free_rows(self, free: Sequence[int]) -> None:
        """After a step of every row (a cache that cannot leave rows out): ``free`` were fed a
        placeholder; one fed too many is reset."""
        due = []
        for row in free:
            self.free_steps[row] += 1
            if self.free_steps[row] >= self.free_step_limit:
                due.append(row)
                self.free_steps[row] = 0
        if due:
            self.cache.reset_rows(due)

    # -- what the scheduler and /metrics read ------------------------------------------------------------
    def evicted(self, row: int) -> int:
        return sum(int(layer.evicted[row].sum()) for layer in self.cache.layers)

    def recalled(self, row: int) -> int:
        return pages_recalled(self.cache, row)
