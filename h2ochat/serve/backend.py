"""The scheduler's ``Backend`` on a real model: one ``H2OCache`` of N rows, 1-row prefill caches.

The batch cache has static shapes: every decode step feeds all N rows (free rows a dummy token),
attends over all C slots of each and evicts in place, so ``--compile`` captures one graph. A
newcomer's prompt is fed in ``prefill_chunk`` pieces into a 1-row cache of the same settings
(resumed from a parked conversation when one matches), then copied into free rows with
``H2OCache.import_row``. A row that ends is exported to the parked store and reset.

What a resumed conversation equals: the chat REPL's conversation on one cache that was never
reset. The parked cache is the row's state when its request ended (the prompt and every
generated token but the last fed), and a resumed request first feeds that last token (unless it
was a stop token: the chat template closes the turn with its own tokens) and then the new text,
exactly as ``Conversation.send`` does on its next turn.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..cache import H2OCache
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


def row_evictions(state_layers) -> int:
    return sum(int(layer["evicted"].sum()) for layer in state_layers)


class ModelBackend:
    """Backend over ``model`` with ``rows`` sequence rows of ``settings``' cache."""

    def __init__(self, model, settings: CacheSettings, rows: int, *, store: ParkedStore, prefill_chunk: int,
                 compile: bool = False, compile_backend: str | None = None):
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
        self.slots = settings.slots(config)
        if self.policy.grows:
            settings = replace(settings, policy="local", heavy_ratio=None, sinks=None, decay=None)
            self.settings = settings
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache = self._new_cache(rows, static_shapes=True)
        self.decode_step = None
        if compile:
            from ..compiled import CompiledDecode

            self.decode_step = CompiledDecode(model, backend=compile_backend)
        # a free row is fed dummy tokens: reset it before its positions could reach the model's limit
        self.free_steps = [0] * rows
        self.free_step_limit = max(1, self.max_positions // 2)

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
        request.cached_tokens = start
        request.fed_ids = list(ids[start:])
        request.kv_slots = self.slots
        tensor = torch.tensor([request.fed_ids], dtype=torch.long, device=self.device)
        return PrefillJob(request, cache, tensor, evicted_before=evicted)

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
        job.request.evicted_tokens += job.cache.evicted_tokens() - job.evicted_before

    def abort(self, job: PrefillJob) -> None:
        job.cache.layers.clear()

    def decode(self, tokens: list[int]) -> torch.Tensor:
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device).view(-1, 1)
        with torch.inference_mode():
            if self.decode_step is not None:
                logits = self.decode_step(self.cache, input_ids)
            else:
                logits = forward(self.model, self.cache, input_ids, logits_to_keep=1)[:, -1]
        return logits

    def warm_up(self) -> None:
        """One decode step of dummy tokens (a compiled step is built here), then every row reset."""
        self.decode([0] * self.rows)
        for row in range(self.rows):
            self.cache.reset_row(row)

    def decoded(self, free: list[int]) -> None:
        """After a decode step: the free rows were fed one more dummy token."""
        for row in free:
            self.free_steps[row] += 1
            if self.free_steps[row] >= self.free_step_limit:
                self.cache.reset_row(row)
                self.free_steps[row] = 0

    def release(self, row: int, choice: Choice | None) -> None:
        if choice is not None:
            tokens, fed, text = choice.conversation()
            state = self.cache.export_row(row, device="cpu")
            self.store.park(Parked(tuple(tokens), fed, text, state, state.nbytes))
        self.cache.reset_row(row)
        self.free_steps[row] = 0

    def evicted(self, row: int) -> int:
        return sum(int(layer.evicted[row].sum()) for layer in self.cache.layers)
