"""One bound on the host memory of many cold stores (a server's ``--recall-memory``): the stores of every
cache it is attached to (the batch's rows, the caches prompts are read into) share it.

What counts is what the stores have written (``ColdStore.written_nbytes``: each row's keys, values and scales
as far as its tokens reach, the token indices and positions of the stores' length), which is what they take in
memory (``host_buffers``: a store's pages past its rows' tokens are never written). Each store reports its figure
after it changed (``note``); the bound sums the last figures, so asking costs nothing per token.

At the bound, further evicted tokens are not kept, as plain H2O keeps none: before an append the tier asks
which rows may append (``admitted``) and the others' tokens are dropped and counted. The rows holding the
fewest cold tokens are admitted first, so the longest conversations give first; no append takes the stores'
bytes past the bound. Tokens already kept stay until their row is emptied (its conversation ended and was
parked or dropped), which gives their bytes back. A row moved into a store (a conversation installed from the
cache its prompt was read into, or resumed) is copied whole, never cut: its tokens were kept once already, and
the copy may hold the stores past the bound until a row is emptied (then appends stop until it is under again).
"""

from __future__ import annotations

import weakref

import torch

from .layout import grown_slots, rows_held

# the bound when none is given (h2ochat serve's --recall-memory, the vLLM plugin's recall_memory), if half the
# free host memory is more: a 135M model's store is ~18 KiB per evicted token, so 4 GiB keeps ~230,000 evicted
# tokens in all, 26 rows' full 8,192-token windows
DEFAULT_LIMIT = 4 << 30


class ColdBound:
    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"a bound on the cold stores' memory must be at least 1 byte, got {limit}")
        self.limit = limit
        self._written: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> bytes it last noted
        self._copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> how many times it will be held
        self.dropped_tokens = 0  # per layer and KV head, as the cold stores count their tokens
        self.peak = 0  # the most bytes in use at once

    def attach(self, cache, copies: int = 1) -> None:
        """Bound the cold stores of ``cache``'s allocated recall tiers (a cache without one: nothing). ``copies``:
        2 for a cache a prompt is read into, whose row is then copied into the batch (and the cache kept for the
        next prompt): each token it keeps is admitted for both copies, so the copy stays within the bound."""
        for layer in cache.layers:
            cold = getattr(getattr(layer, "tier", None), "cold", None)
            if cold is not None:
                self._copies[cold] = copies
                cold.bounded_by(self)

    def note(self, store) -> None:
        """``store``'s written bytes changed (it grew, was appended to, fitted, or a row was emptied)."""
        self._written[store] = store.written_nbytes()
        self.peak = max(self.peak, self.in_use)

    @property
    def in_use(self) -> int:
        """Bytes the bounded stores have written, as they last noted them."""
        return sum(self._written.values())

    def admitted(self, store, growth: int, row_bytes: dict[int, int], held: dict[int, int]) -> list[int]:
        """The rows of ``store`` whose append fits under the bound: ``growth``, the bytes the append adds to the
        store whatever rows append (the bookkeeping of the slots a growth adds), and ``row_bytes``, what each
        row's tokens add. Rows holding fewer tokens (``held``) first; none where the growth does not fit."""
        copies = self._copies.get(store, 1)
        room = self.limit - self.in_use - growth * copies
        kept = []
        for row in sorted(row_bytes, key=lambda row: (held[row], row)):
            if row_bytes[row] * copies <= room:
                kept.append(row)
                room -= row_bytes[row] * copies
        return sorted(kept) if room >= 0 else []

    def refused(self, tokens: int) -> None:
        """``tokens`` evicted tokens (per layer and KV head) were not kept: the bound was reached."""
        self.dropped_tokens += tokens


def append_bytes(store, added: torch.Tensor, needed: int) -> tuple[int, list[int]]:
    """What an append of ``added`` [B, H] tokens to a ``ColdStore``, room made by ``reserve(needed)``, adds to its
    ``written_nbytes``: the bytes of the slots a growth gives every row (their token indices and positions are
    written whole), and each row's keys, values and scales as far as its tokens reach [B]."""
    capacity, heads = store.capacity, store.heads
    after = capacity if store.frames is not None else grown_slots(capacity, needed, store.page)
    whole, by_row = store.slot_bytes()
    count = store.count.cpu()
    before = [min(held, capacity) for held in rows_held(count)]
    grown = [min(held, after) for held in rows_held(count + added.to("cpu"))]
    growth = (after - capacity) * count.shape[0] * heads * whole
    return growth, [(new - old) * heads * by_row for new, old in zip(grown, before)]
