"""Page digests kept on the device, appended as tokens are evicted, scored by the current queries.

``KeyCodes`` keeps each cold key as b-bit codes with a per-token scale and offset (``bits=None``:
the keys themselves, the exact selector), in the cold store's layout (``layout``: slot n of a
(sequence, head) is its n-th evicted token; a ring of ``frames`` pages under --cold-limit). The codes
are made from the evicted keys while they are still on the device, so the digest never needs the
host copy. ``rotate``: keys (and the queries scoring them) are turned by a fixed spreading rotation
first, so a few outlier channels no longer set every token's quantiser range.

Device bytes per token: ceil(D / (8 // bits)) for the codes packed 8 // bits to a byte
(``h2ochat_kernels.pack_codes``) plus 4 for the fp16 scale and offset; int4 at D = 64: 32 + 4 = 36
bytes, 0.28 of an fp16 key's 128 (int2: 20, 0.16; int3 packs 2 to a byte like int4). Which token a
slot holds is not stored: it follows from the per-(sequence, head) count (``number``).

The coded selectors' default digest, ``TwoStageCodes`` (``two_stage``), keeps one of these
beside the cold store and bounded page summaries on the device.
"""

from __future__ import annotations

import torch

import h2ochat_kernels as kernels
from h2ochat_kernels.rotation import spreading_rotation

from .layout import FirstRows, Writes, best_pages, growable, held_pages, rows_held, tensor_bytes, widened
from h2ochat_kernels.cpu import recall_ops as native
from .selectors import packed_quantize, score_pages


class KeyCodes(FirstRows):
    def __init__(self, batch: int, heads: int, head_dim: int, page: int, bits: int | None, *,
                 frames: int | None = None, device=None, dtype=torch.float32, initial_pages: int = 4,
                 rotate: bool = False, backend: kernels.Backend | None = None):
        if bits is not None and not 1 <= bits <= 8:
            raise ValueError(f"digest bits must be 1-8, got {bits}")
        self.page, self.bits, self.frames = page, bits, frames
        self.backend = backend  # the page-score kernels (a cache layer's choice; None: the device's, per call)
        # (the exact digest is the keys themselves: nothing to turn)
        self.rotation = spreading_rotation(head_dim, device) if rotate and bits is not None else None
        slots = (frames or initial_pages) * page + 1  # + the spill slot (``layout.Writes``)
        self.scale = self.offset = None
        if bits is None:
            self.codes = torch.zeros(batch, heads, slots, head_dim, dtype=dtype, device=device)
        else:
            width = kernels.packed_width(head_dim, bits)
            self.codes = torch.zeros(batch, heads, slots, width, dtype=torch.uint8, device=device)
            self.scale = torch.ones(batch, heads, slots, dtype=torch.float16, device=device)
            self.offset = torch.zeros(batch, heads, slots, dtype=torch.float16, device=device)
        self.count = torch.zeros(batch, heads, dtype=torch.long, device=device)  # tokens ever appended
        if frames is None:
            for name in self._per_slot():
                growable(getattr(self, name))

    def _per_slot(self) -> tuple[str, ...]:
        return ("codes",) if self.bits is None else ("codes", "scale", "offset")

    def _grow(self, needed: int) -> None:
        held = rows_held(self.count)  # (copied row by row: a row's memory follows its length)
        for name in self._per_slot():
            setattr(self, name, widened(getattr(self, name), needed, 0, spill=True, page=self.page, rows_held=held,
                                         room=True))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in (*self._per_slot(), "count")}

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` tokens per (sequence, head), decided on the host before a step."""
        if self.frames is None and needed > self.capacity:
            self._grow(needed)

    @property
    def capacity(self) -> int:
        """Slots per (sequence, head), less the spill slot the appends of rows that evicted nothing hit."""
        return self.codes.shape[2] - 1

    def _turned(self, keys_or_queries: torch.Tensor) -> torch.Tensor:
        return keys_or_queries if self.rotation is None else keys_or_queries.float() @ self.rotation

    def turned(self, queries: torch.Tensor) -> torch.Tensor:
        """Queries as the codes are scored: turned by the spreading rotation (``rotN``), else as given."""
        return self._turned(queries)

    def _write_digest(self, keys: torch.Tensor, write) -> None:
        """``write(buffer, new)`` for each per-slot buffer, ``new`` made from ``keys`` [B, H, S, D]."""
        if self.bits is None:
            write(self.codes, keys)
            return
        codes, scale, offset = packed_quantize(self._turned(keys), self.bits)
        write(self.codes, codes)
        write(self.scale, scale)
        write(self.offset, offset)

    def append(self, keys: torch.Tensor, token_index: torch.Tensor, *, reserve: bool = True) -> None:
        """The evicted keys [B, H, E, D] (token index -1: nothing evicted there), in eviction order.
        ``reserve=False``: the caller reserved room; else growing reads the count back."""
        valid = token_index >= 0
        added = valid.sum(dim=-1)
        if reserve:
            self.reserve(int((self.count + added).max()))
        writes = Writes.plan(valid, self.count, self.frames * self.page if self.frames is not None else None,
                             spill=self.capacity)
        self._write_digest(keys, writes.write)
        self.count += added

    def rebuild(self, keys_by_slot: torch.Tensor) -> None:
        """After a re-numbering (RoPE): the digest of every held token again, from its key at its new
        position (``ColdStore.keys_by_slot``, the same slot numbering: slot n, or n mod the ring),
        so pages are scored as the keys will be attended. Rare: once per re-numbering."""
        number = self.number
        held = number >= 0
        source = number.clamp(min=0).to(keys_by_slot.device)
        if self.frames is not None:
            source = source % keys_by_slot.shape[2]
        keys = keys_by_slot.gather(2, source.unsqueeze(-1).expand(*source.shape, keys_by_slot.shape[-1]))

        def write(buffer, new):
            where = held.view(*held.shape, *([1] * (buffer.dim() - 3)))
            slots = buffer[:, :, : self.capacity]
            slots.copy_(torch.where(where, new.to(buffer.dtype), slots))

        self._write_digest(keys.to(self.codes.device), write)

    # -- which token each slot holds, from the count -------------------------------------------------
    def _numbers(self, slots: int) -> torch.Tensor:
        """[B, H, slots]: the slot number each of the first ``slots`` store slots holds (-1: none): the latest
        n < count written there, n mod the store's size (a ring's; a store that never wraps: the slot)."""
        slot = torch.arange(slots, device=self.count.device)
        latest = (self.count - 1).unsqueeze(-1)
        if self.frames is None:  # (never wraps: one compare, not a remainder over every slot)
            return torch.where(slot <= latest, slot, -1)
        number = latest - (latest - slot).remainder(self.capacity)
        return number.masked_fill(number < 0, -1)

    def _held(self, number: torch.Tensor) -> torch.Tensor:
        first, _ = held_pages(self.count, self.page, self.frames)
        return number >= (first * self.page).unsqueeze(-1)

    def _page_numbers(self, number: torch.Tensor) -> torch.Tensor:
        batch, heads, slots = number.shape
        latest = number.view(batch, heads, slots // self.page, self.page).amax(dim=-1)
        return torch.where(latest >= 0, latest // self.page, -1)

    def scored_slots(self, upto: int | None) -> int:
        """The leading slots to score: all, or ``upto`` rounded up to whole pages (at least one page,
        at most the store)."""
        size = self.capacity
        if upto is None:
            return size
        return min(max(-(-upto // self.page), 1) * self.page, size)

    @property
    def number(self) -> torch.Tensor:
        """[B, H, S]: the absolute slot number (n-th evicted token) each store slot holds, -1: none."""
        return self._numbers(self.capacity)

    @property
    def valid(self) -> torch.Tensor:
        """[B, H, S] bool: ring slots holding a token of a page still held (an older page's leftovers
        in a frame a newer page has started are not)."""
        return self._held(self.number)

    def page_numbers(self, upto: int | None = None) -> torch.Tensor:
        """[B, H, F]: the absolute page number each frame holds now (-1: none); the first F frames
        with ``upto`` (as ``scores``)."""
        return self._page_numbers(self._numbers(self.scored_slots(upto)))

    # -- scoring --------------------------------------------------------------------------------------
    def _scores(self, queries: torch.Tensor, number: torch.Tensor) -> torch.Tensor:
        slots = number.shape[2]

        def leading(t):  # the scored slots, a view: the store is not copied per step
            return None if t is None else t[:, :, :slots]

        return score_pages(self._turned(queries), leading(self.codes), leading(self.scale), leading(self.offset),
                           self._held(number), self.page, self.bits, backend=self.backend)

    def scores(self, queries: torch.Tensor, upto: int | None = None) -> torch.Tensor:
        """queries [B, H, M, D] -> [B, H, F]: each stored page's best q.k (-inf: no token). ``upto``: a
        bound known on the host of the slots in use (every row's count, or more); only the first
        F = ceil(upto / page) frames are scored (without a ring up to half the store is empty)."""
        return self._scores(queries, self._numbers(self.scored_slots(upto)))

    def top_pages(self, queries: torch.Tensor, count: int, upto: int | None = None) -> torch.Tensor:
        """[B, H, k] absolute page numbers of the best ``count`` pages (-1 where fewer pages; k is
        fewer than ``count`` only where fewer frames are scored)."""
        if self.bits is None and self.frames is None:  # the keys themselves, never a ring: one C call (a CPU's)
            wanted = native.top_pages(self._turned(queries), self.codes[:, :, :self.scored_slots(upto)], self.count,
                                      self.page, count)
            if wanted is not None:
                return wanted
        number = self._numbers(self.scored_slots(upto))
        return best_pages(self._scores(queries, number), self._page_numbers(number), count)

    cap = None  # (one stage: every page scored on the device, no cap)
    pages_per_entry = 1

    def host_nbytes(self) -> int:
        return 0

    def nbytes(self) -> int:
        """The digest's device bytes: codes, scale and offset per slot, and the count (see the module
        docstring for a token's share)."""
        return tensor_bytes(self.state_tensors().values())
