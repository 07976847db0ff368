"""The scheduler's ``Backend`` on a real model: one ``H2OCache`` of N rows, 1-row prefill caches.

The batch cache has static shapes. A decode step runs the smallest bucket of rows (1, 2, 4, ... N)
that holds the rows in use (the scheduler keeps them at the front, ``move``): each bucket is a cache
over the first rows of the batch cache, sharing its slots (views, so nothing is copied and a
compiled step captures one graph per bucket, as vLLM captures one per batch size), and the free rows
inside it are left out of the step by the cache's ``active`` mask: they write nothing, and their
counters stand still. Every step attends over all C slots of each row and evicts in place. A
newcomer's prompt is fed in ``prefill_chunk`` pieces into a 1-row cache of the same settings
(resumed from a parked conversation when one matches), then copied into free rows with
``H2OCache.import_row``. A row that ends is exported to the parked store and reset.

A cache that cannot leave rows out of a step (``masks_inactive_rows`` False: a recall tier, whose
evictions go to its cold store) runs all N rows every step: free rows are fed a placeholder token
(their output is ignored) and reset before their positions could reach the model's limit.

What a resumed conversation equals: the chat REPL's conversation on one cache that was never
reset. The parked cache is the row's state when its request ended (the prompt and every
generated token but the last fed), and a resumed request first feeds that last token (unless it
was a stop token: the chat template closes the turn with its own tokens) and then the new text,
exactly as ``Conversation.send`` does on its next turn.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from ..kv import H2OCache
from ..kv.tier import pages_recalled
from ..recall.default import is_off
from ..generation import CacheSettings, forward, max_positions, prefill
from .parked import Parked, ParkedStore
from .sequence import Choice, Request


@dataclass
class PrefillJob:
    request: Request
    cache: H2OCache
    ids: torch.Tensor  # [1, T] the prompt tokens still to feed
    fed: int = 0
    evicted_before: int = 0  # the resumed cache's evictions (counted by the request that made them)
    recalled_before: int = 0  # and its pages recalled


def row_evictions(state_layers) -> int:
    return sum(int(layer["evicted"].sum()) for layer in state_layers)


class ModelBackend:
    """Backend over ``model`` with ``rows`` sequence rows of ``settings``' cache."""

    def __init__(self, model, settings: CacheSettings, rows: int, *, store: ParkedStore, prefill_chunk: int,
                 compile: bool = False, compile_backend: str | None = None, buckets: Sequence[int] | None = None):
        self.model, self.settings, self.rows, self.store = model, settings, rows, store
        self.prefill_chunk = prefill_chunk
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config = model.config
        self.max_positions = max_positions(config)
        self.policy = settings.resolved_policy()
        # the full policy never evicts: each row reserves --budget slots up front and a conversation
        # longer than that is refused (the preparer), as llama.cpp's server divides its context among
        # its slots. Its rows are kept in a sliding window of those slots, which a conversation never
        # fills, so it never slides: the same attention over every token, and no cache that grows
        # (a growing cache sizes itself by a counter of the batch's steps, not by what a row holds)
        self.slots = settings.slots(config, model)  # (a --budget in bytes: at the model's dtype)
        if self.policy.grows:
            settings = replace(settings, policy="local", heavy_ratio=None, sinks=None, decay=None)
            self.settings = settings
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # static shapes for the compiled step's graphs and the row buckets; a recall tier runs every row
        # anyway, and with static shapes it chooses a decode step's pages before the step (the compiled
        # step's rule, not the REPL's): eager, it keeps the REPL's shapes and rule
        self.cache = self._new_cache(rows, static_shapes=compile or is_off(settings.recall))
        self.decode_step = None
        if compile:
            from ..compiled import CompiledDecode

            self.decode_step = CompiledDecode(model, backend=compile_backend)
        self.masks_rows = self.cache.masks_inactive_rows
        # rows a decode step may run, and the caches over the first rows of the batch cache for each,
        # made now: each is allocated before its slots become views (smallest first, so the memory
        # taken at once is the batch cache's and half of it at most), not while requests run
        self.buckets = sorted(set(buckets)) if buckets else bucket_sizes(rows)
        if not self.masks_rows or self.buckets[-1] != rows:
            self.buckets = [rows]
        self._prefixes: dict[int, H2OCache] = {rows: self.cache}
        for size in self.buckets[:-1]:
            self._prefixes[size] = self.cache.prefix(size)
        self.steps_by_rows: dict[int, int] = {}  # decode steps run per bucket size
        # a cache that cannot leave rows out feeds its free rows a placeholder: reset one before its
        # positions could reach the model's limit, and before it fills its slots (then a placeholder
        # would be evicted, into the cold store of a recall tier: a free row keeps its tier empty)
        self.free_steps = [0] * rows
        self.free_step_limit = max(1, min(self.max_positions // 2, *(layer.capacity // 2 for layer in self.cache.layers)))

    def _new_cache(self, batch: int, *, static_shapes: bool) -> H2OCache:
        cache = self.settings.build(self.model, static_shapes=static_shapes)
        cache.allocate(batch, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        return cache

    def row_bytes(self) -> int:
        """Device bytes one row holds (keys, values and their bookkeeping)."""
        return (self.cache.kv_bytes() + self.cache.bookkeeping_bytes()) // self.rows

    # -- the Backend interface --------------------------------------------------------------------
    def begin(self, request: Request) -> PrefillJob:
        ids = request.prompt_ids
        parked = self.store.take(ids)
        # the 1-row cache is the REPL's own kind (no static shapes): the prompt is read exactly as a chat reads it
        cache = self._new_cache(1, static_shapes=False)
        start, evicted = 0, 0
        if parked is not None:
            cache.import_row(0, parked.state)
            start, evicted = parked.fed, row_evictions(parked.state.layers)
        request.began(start, list(ids[start:]), self.slots)
        tensor = torch.tensor([request.fed_ids], dtype=torch.long, device=self.device)
        return PrefillJob(request, cache, tensor, evicted_before=evicted, recalled_before=pages_recalled(cache, 0))

    def prefill(self, job: PrefillJob) -> torch.Tensor | None:
        end = min(job.fed + self.prefill_chunk, job.ids.shape[1])
        with torch.inference_mode():
            logits = prefill(self.model, job.cache, job.ids[:, job.fed:end], chunk=self.prefill_chunk)
        job.fed = end
        return logits[0] if end == job.ids.shape[1] else None

    def install(self, job: PrefillJob, rows: list[int]) -> None:
        state = job.cache.export_row(0, device=self.device)
        for row in rows:
            self.cache.import_row(row, state)
            self.free_steps[row] = 0
        job.request.count_evicted(job.cache.evicted_tokens() - job.evicted_before,
                                  pages_recalled(job.cache, 0) - job.recalled_before)

    def abort(self, job: PrefillJob) -> None:
        job.cache.layers.clear()

    def bucket(self, rows: int) -> int:
        """The rows a decode step runs when rows 0..rows-1 are in use: the smallest bucket holding them."""
        return next(size for size in self.buckets if size >= rows)

    def move(self, source: int, target: int) -> None:
        """Row ``source``'s cache into the free row ``target`` (on the device), ``source`` reset."""
        self.cache.import_row(target, self.cache.export_row(source, device=self.device))
        self.cache.reset_row(source)
        self.free_steps[target] = self.free_steps[source] = 0

    def decode(self, tokens: list[int | None]) -> torch.Tensor:
        """One step of the rows in use (``tokens[row]``, None for a free row): the logits of the
        bucket's rows [R, V] (the free rows' are meaningless)."""
        if not self.masks_rows:
            return self._decode_every_row(tokens)
        in_use = [row for row, token in enumerate(tokens) if token is not None]
        size = self.bucket(in_use[-1] + 1 if in_use else 1)
        fed = [token if token is not None else 0 for token in tokens[:size]]  # (a row left out reads nothing)
        return self._step(size, fed, [token is not None for token in tokens[:size]])

    def _step(self, size: int, tokens: list[int], active: list[bool] | None) -> torch.Tensor:
        """One decode step of the cache over rows 0..size-1 (``active``: the rows taking part; None: all)."""
        cache = self._prefixes[size]
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device).view(-1, 1)
        mask = torch.tensor(active, dtype=torch.bool, device=self.device) if active is not None else None
        self.steps_by_rows[size] = self.steps_by_rows.get(size, 0) + 1
        if cache is not self.cache:
            cache.take_host_counters(self.cache)
        try:
            with torch.inference_mode():
                if self.decode_step is not None:
                    return self.decode_step(cache, input_ids, mask)
                return forward(self.model, cache, input_ids, logits_to_keep=1, active=mask)[:, -1]
        finally:
            if cache is not self.cache:
                self.cache.take_host_counters(cache)

    def _decode_every_row(self, tokens: list[int | None]) -> torch.Tensor:
        """The step of a cache that cannot leave rows out: every row, free ones fed a placeholder."""
        logits = self._step(self.rows, [token if token is not None else 0 for token in tokens], None)
        for row, token in enumerate(tokens):
            if token is None:
                self.free_steps[row] += 1
                if self.free_steps[row] >= self.free_step_limit:
                    self.cache.reset_row(row)
                    self.free_steps[row] = 0
                    self._lower_fed_bound()
        return logits

    def _lower_fed_bound(self) -> None:
        """After a reset: the layers' count of columns fed (the bound a recall tier reserves its stores'
        room by, grown by every step of every row) back to what the rows hold now, the largest row's
        tokens fed, so the cold stores grow with the longest conversation, not with the server's
        uptime. (A decode step feeds every row one column: no padding in the batch cache.)"""
        if self.masks_rows:
            return
        fed = int(self.cache.tokens_fed.max())
        for layer in self.cache.layers:
            in_use, counted = layer.host_counters()
            if counted > fed:
                layer.set_host_counters(in_use, fed)

    def warm_up(self) -> None:
        """One decode step of every bucket with every row left out (a compiled step is built here for
        each): nothing is written, and the host counters are put back."""
        if not self.masks_rows:
            self._decode_every_row([None] * self.rows)
            for row in range(self.rows):
                self.cache.reset_row(row)
            return
        before = self.cache.host_counters()
        for size in self.buckets:
            self._step(size, [0] * size, [False] * size)
        self.cache.restore_host_counters(before)

    def release(self, row: int, choice: Choice | None) -> None:
        if choice is not None:
            tokens, fed, text = choice.conversation()
            state = self.cache.export_row(row, device="cpu")
            self.store.park(Parked(tuple(tokens), fed, text, state, state.nbytes))
        self.cache.reset_row(row)
        self.free_steps[row] = 0
        self._lower_fed_bound()

    def evicted(self, row: int) -> int:
        return sum(int(layer.evicted[row].sum()) for layer in self.cache.layers)

    def recalled(self, row: int) -> int:
        return pages_recalled(self.cache, row)

    def tier_gauges(self) -> dict[str, tuple[str, float]]:
        """The tier's figures for ``/metrics`` (none without a tier): its host bytes (the cold stores)
        and its device bytes (the page selector's; staging and frames where the tier reports them).
        Reads the device: the engine asks now and then, not every step."""
        stats = self.cache.tier_stats()
        if stats is None:
            return {}
        def figure(*names):  # (the first field the tier's stats have: their names have changed before)
            return next((getattr(stats, name) for name in names if getattr(stats, name, None) is not None), 0)
        return {
            "recall_cold_host_bytes": ("Host bytes of the recall tier's cold stores (every row of the batch).",
                                       figure("cold_host_bytes", "host_bytes")),
            "recall_selector_device_bytes": ("Device bytes of the recall tier's page selector (digests).",
                                             figure("device_bytes_selector", "digest_device_bytes")),
            "recall_device_bytes": ("Device bytes of the recall tier beyond its slots (selector, staging, frames).",
                                    figure("device_bytes", "digest_device_bytes")),
            "recall_cold_tokens": ("Tokens held in the cold stores (per layer and KV head, summed).",
                                   figure("cold_tokens")),
            "recall_staged_tokens": ("Evicted tokens on the staging pages, not yet in the cold stores.",
                                     figure("staged_tokens")),
            "recall_pages_per_summary": ("Pages each device page summary covers (above 1: the summary cap was "
                                         "reached and the summaries coarsened).", figure("pages_per_summary") or 1),
            "recall_pages_copied": ("Pages brought into recall slots since the batch cache was made.",
                                    figure("pages_copied")),
        }


def bucket_sizes(rows: int) -> list[int]:
    """1, 2, 4, ... below ``rows``, then ``rows``."""
    sizes = [1 << power for power in range(max(rows - 1, 0).bit_length())]
    return [size for size in sizes if size < rows] + [rows]

