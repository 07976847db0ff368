"""The scheduler's ``Backend`` on a real model: a row pool (``serve.rows``: the batch cache, its
buckets, the parked conversations) and a model runner (``serve.runner``: the forwards) put together.
How rows, buckets and parking work is said in ``serve.rows``.

What a resumed conversation equals: the chat REPL's conversation on one cache that was never
reset. The parked cache is the row's state when its request ended (the prompt and every
generated token but the last fed), and a resumed request first feeds that last token (unless it
was a stop token: the chat template closes the turn with its own tokens) and then the new text,
exactly as ``Conversation.send`` does on its next turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..kv import H2OCache
from ..kv.tier import pages_recalled
from ..recall.cold_bound import ColdBound
from ..engine.generation import CacheSettings, max_positions
from .parked import ParkedStore
from .rows import RowPool
from .runner import ModelRunner
from .sequence import Choice, Request


@dataclass
class PrefillJob:
    request: Request
    cache: H2OCache
    ids: torch.Tensor  # [1, T] the prompt tokens still to feed
    fed: int = 0
    evicted_before: int = 0  # the resumed cache's evictions (counted by the request that made them)
    recalled_before: int = 0  # and its pages recalled
    home: int | None = None  # the batch row its parked copy rests in (``RowPool.placement`` puts it back there)


def compiles_by_default(cache: H2OCache, device: torch.device | str = "cpu") -> bool:
    """Whether a server compiles its decode step when not told: when the step covers the cache
    (``H2OCache.compile_blocker``) and its rows run as bucket views, or it is a recall tier's on the CPU,
    whose graph chooses a step's pages inside it with the step's own queries, as the eager step does
    (``recall.graph_choice``; a GPU's graph would choose them before the step)."""
    if cache.compile_blocker() is not None:
        return False
    if cache.tier.columns:  # (a recall tier, buckets or not)
        return torch.device(device).type == "cpu"
    return cache.row_prefixes


class ModelBackend:
    """Backend over ``model`` with ``rows`` sequence rows of ``settings``' cache."""

    def __init__(self, model, settings: CacheSettings, rows: int, *, store: ParkedStore, prefill_chunk: int,
                 compile: bool | None = False, compile_backend: str | None = None,
                 buckets: Sequence[int] | None = None, mixed_steps: bool = True, cold_bound: ColdBound | None = None):
        """``compile``: decode through the compiled step; None: where it serves the cache's rows as they
        are (``compiles_by_default``). ``mixed_steps``: read a prompt chunk and decode the running rows
        in one forward (``mixes``). ``cold_bound``: the bound on every cache's recall cold stores
        (``--recall-memory``; None: none)."""
        self.settings, self.rows = settings, rows
        self.cold_bound = cold_bound
        self.mixed_steps = mixed_steps
        config = model.config
        self.policy = settings.resolved_policy()
        self.slots = settings.slots(config, model)  # (a --budget in bytes: at the model's dtype)
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.runner = ModelRunner(model, prefill_chunk=prefill_chunk)
        # static shapes for the compiled step's graphs and the row buckets; a cache without buckets
        # (a tier that steps every row), eager, keeps the REPL's shapes
        plain = settings.build(model)  # (an unallocated cache: it holds nothing)
        prefixes = plain.row_prefixes
        if compile is None:
            compile = compiles_by_default(plain, self.runner.device)
        self.pool = RowPool(self._new_cache, rows, store=store, device=self.runner.device,
                            max_positions=max_positions(config), static_shapes=compile or prefixes, buckets=buckets)
        if compile:
            self.runner.compile(compile_backend, graphs=len(self.pool.buckets))

    @property
    def compiled(self) -> bool:
        return self.runner.decode_step is not None

    def _new_cache(self, batch: int, *, static_shapes: bool) -> H2OCache:
        cache = self.settings.build(self.runner.model, static_shapes=static_shapes)
        cache.keep_columns()  # (the full policy: each row's text stays within its slots, see serve.rows)
        cache.allocate(batch, self.kv_heads, self.head_dim, dtype=self.runner.dtype, device=self.runner.device)
        if self.cold_bound is not None:  # (the batch's and the prompts' caches: one bound for their stores)
            prompts = getattr(self, "pool", None) is not None  # (the pool makes the batch's cache first)
            self.cold_bound.attach(cache, copies=2 if prompts else 1)
        return cache

    # -- what tests, tools and the engine read ---------------------------------------------------------
    @property
    def cache(self) -> H2OCache:
        return self.pool.cache

    @property
    def store(self) -> ParkedStore:
        return self.pool.store

    @property
    def decode_step(self):
        return self.runner.decode_step

    @property
    def buckets(self) -> list[int]:
        return self.pool.buckets

    @property
    def masks_rows(self) -> bool:
        return self.pool.masks_rows

    @property
    def steps_by_rows(self) -> dict[int, int]:
        return self.pool.steps_by_rows

    def row_bytes(self) -> int:
        return self.pool.row_bytes()

    # -- the Backend interface --------------------------------------------------------------------
    def begin(self, request: Request) -> PrefillJob:
        ids = request.prompt_ids
        cache, parked, home = self.pool.prefill_cache(ids)
        start, evicted = (parked.fed, cache.evicted_tokens()) if parked is not None else (0, 0)  # (what it holds)
        request.began(start, list(ids[start:]), self.slots)
        tensor = torch.tensor([request.fed_ids], dtype=torch.long, device=self.runner.device)
        return PrefillJob(request, cache, tensor, evicted_before=evicted, recalled_before=pages_recalled(cache, 0),
                          home=home)

    def prefill(self, job: PrefillJob) -> torch.Tensor | None:
        job.fed, logits = self.runner.prefill_chunk_of(job.cache, job.ids, job.fed)
        return logits

    def placement(self, job: PrefillJob, free: list[int], count: int) -> list[int]:
        return self.pool.placement(free, count, job.home)

    def install(self, job: PrefillJob, rows: list[int]) -> None:
        self.pool.install(job.cache, rows, job.home)
        job.request.count_evicted(job.cache.evicted_tokens() - job.evicted_before,
                                  pages_recalled(job.cache, 0) - job.recalled_before)

    def abort(self, job: PrefillJob) -> None:
        job.cache.reset()  # its slots go back now, not when the job is collected
        self.pool.forget_home(job.home)

    def bucket(self, rows: int) -> int:
        return self.pool.bucket(rows)

    def move(self, source: int, target: int) -> None:
        self.pool.move(source, target)

    def release(self, row: int, choice: Choice | None) -> None:
        self.pool.release(row, choice)

    def evicted(self, row: int) -> int:
        return self.pool.evicted(row)

    def recalled(self, row: int) -> int:
        return self.pool.recalled(row)

    def decode(self, tokens: list[int | None]) -> torch.Tensor:
        """One step of the rows in use (``tokens[row]``, None for a free row): the logits of the
        bucket's rows [R, V] (the free rows' are meaningless)."""
        fed = self._fed(tokens)
        if not self.pool.masks_rows:
            with self.pool.bucket_cache(self.rows) as cache:
                logits = self.runner.decode(cache, fed, None)
            self.pool.stepped_free_rows([row for row, token in enumerate(tokens) if token is None])
            return logits
        size, active = self._bucket_of(tokens)
        with self.pool.bucket_cache(size) as cache:
            return self.runner.decode(cache, fed[:size], active)

    def _bucket_of(self, tokens: list[int | None]) -> tuple[int, list[bool]]:
        """The bucket a masked step runs for these rows in use, and which of its rows take part."""
        in_use = [row for row, token in enumerate(tokens) if token is not None]
        size = self.pool.bucket(in_use[-1] + 1 if in_use else 1)
        return size, [token is not None for token in tokens[:size]]

    @staticmethod
    def _fed(tokens: list[int | None]) -> list[int]:
        """What each row reads: its token, or a placeholder for a free row (which reads nothing)."""
        return [token if token is not None else 0 for token in tokens]

    @property
    def mixes_steps(self) -> bool:
        """Whether prompt chunks run in one forward with the decode steps (``mixes``): when told to
        (``mixed_steps``) and the rows left out of a step are masked (``masks_rows``)."""
        return self.mixed_steps and self.pool.masks_rows

    def mixes(self, job: PrefillJob) -> bool:
        """Whether the job's next chunk and the next decode step run as one forward (``mixed``).

        Measured on SmolLM2-135M, bf16, one thread (``benchmarks/mixed_step.py``, results_mixed_step_s53.json and
        results_mixed_steps_served_s53.json, docs/results.md): one step alone is even (the chunk's products are
        compute-bound, and the decode's weight reads it saves are what the eager half of the step loses against
        the graph); served, the chat-8x4 load is faster mixed, every mixed run above every apart one with the
        compiled step, and no slower eager. So mixing is the default, and ``--no-mixed-steps`` keeps the steps
        apart."""
        return self.mixes_steps and job.fed < job.ids.shape[1]

    def mixed(self, job: PrefillJob, tokens: list[int | None]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``prefill`` and ``decode`` as one forward (``mixes`` said it may): the prompt's logits [V] once
        it is read (else None), and the bucket's rows' logits [R, V]."""
        size, active = self._bucket_of(tokens)
        with self.pool.bucket_cache(size) as cache:
            job.fed, prompt_logits, logits = self.runner.mixed(job.cache, job.ids, job.fed, cache,
                                                               self._fed(tokens[:size]), active)
        return prompt_logits, logits

    def warm_up(self) -> None:
        """One decode step of every bucket with every row left out (a compiled step is built here for
        each): nothing is written, and the host counters are put back."""
        if not self.pool.masks_rows:
            self.decode([None] * self.rows)
            self.pool.cache.reset_rows(range(self.rows))
            return
        with self.pool.counters_kept():
            for size in self.pool.buckets:
                with self.pool.bucket_cache(size) as cache:
                    if self.runner.decode_step is not None:
                        self.runner.prime(cache, size)
                    self.runner.decode(cache, [0] * size, [False] * size)

    def compiled_warm_up(self) -> str | None:
        """``warm_up`` building the compiled step's graphs; where compiling fails (inductor needs a C++
        compiler on a CPU), every later step runs eagerly instead and the reason is returned (else None)."""
        try:
            self.warm_up()
        except Exception as error:  # dynamo and inductor raise many kinds; the eager step needs none of it
            self.runner.decode_eagerly()
            while getattr(error, "inner_exception", None) is not None:  # dynamo wraps the backend's own error
                error = error.inner_exception
            lines = str(error).strip().splitlines()
            return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
        return None

    def tier_gauges(self) -> dict[str, tuple[str, float]]:
        """The tier's figures for ``/metrics`` (none without a tier): its host bytes (the cold stores)
        and its device bytes (the page selector's; staging and frames where the tier reports them).
        Reads the device: the engine asks now and then, not every step."""
        stats = self.pool.cache.tier_stats()
        if stats is None:
            return {}
        def figure(*names):  # (the first field the tier's stats have: their names have changed before)
            return next((getattr(stats, name) for name in names if getattr(stats, name, None) is not None), 0)
        return {
            "recall_cold_host_bytes": ("Host bytes of the recall tier's cold stores (every row of the batch; allocated: "
                                       "the longest row's capacity, address space more than memory).",
                                       figure("cold_host_bytes", "host_bytes")),
            "recall_cold_host_bytes_written": ("Of those, the slots the rows have written: each row's tokens, "
                                               "what the stores take in memory.", figure("host_bytes_written")),
            **self._bound_gauges(),
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

    def _bound_gauges(self) -> dict[str, tuple[str, float]]:
        """--recall-memory's figures: the bound, the bytes it counts, and the evicted tokens it did not keep."""
        bound = self.cold_bound
        if bound is None:
            return {}
        return {
            "recall_memory_bound_bytes": ("--recall-memory: the bound on the host bytes the cold stores of every "
                                          "cache (the batch's rows, the prompts being read) have written.", bound.limit),
            "recall_memory_bytes_in_use": ("Host bytes the cold stores have written, counted against "
                                           "--recall-memory (appends stop at it; a row moved in is copied whole).",
                                           bound.in_use),
            "recall_memory_peak_bytes": ("The most bytes the cold stores held at once since the server started.",
                                         bound.peak),
            "recall_dropped_tokens": ("Evicted tokens not kept because the cold stores were at --recall-memory "
                                      "(per layer and KV head, summed since the server started; dropped as "
                                      "without recall).", bound.dropped_tokens),
        }
