"""Where evicted tokens land in an append-only paged store, shared by the cold store and the digests.

Each (sequence, KV head) appends its evicted tokens in eviction order: the n-th token it ever
evicted has slot number n and page n // P. With a limit the store is a ring of ``frames`` pages: page
p lives in frame p % frames, and writing the first token of page p drops page p - frames.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

import h2ochat_kernels as kernels

from ..host_buffers import lengthened, store_buffer


def append_slots(valid: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Slot numbers [B, H, E] for the valid entries of ``valid`` [B, H, E] appended after ``count``
    [B, H] tokens, in order (-1 for invalid entries)."""
    offsets = valid.long().cumsum(dim=-1) - 1
    return (count.unsqueeze(-1) + offsets).masked_fill(~valid, -1)


def held_pages(count: torch.Tensor, page: int, frames: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """First and one-past-last page number [B, H] each (sequence, head) still holds."""
    end = (count + page - 1) // page
    first = (end - frames).clamp(min=0) if frames is not None else torch.zeros_like(end)
    return first, end


def growable(tensor: torch.Tensor) -> torch.Tensor:
    """Mark a store's slot dimension (2) as one that grows, so a compiled step traces it as a size
    (one graph however long the text) instead of compiling again at every doubling."""
    torch._dynamo.maybe_mark_dynamic(tensor, 2)
    return tensor


GROWTH_MARGIN = 32  # a paged store grows by at least 1/32 of its size: ~3% of bytes, well inside the host-memory bound on recall's growth
# (int8 cold values hold 244 of the 256 bytes a bf16 token and head would), for 4x fewer copies at 1,000 tokens
# and 16x at 4,000 (pages of 8)


ROOM = 2  # a store with room (``widened(room=True)``) reserves twice its slots: each held token copied at most ~twice


def grown_slots(held: int, needed: int, page: int | None) -> int:
    """The slots a store of ``held`` slots has after ``widened`` makes room for ``needed`` (``held`` when it
    has them): with ``page``, ``needed`` in whole pages plus the ``GROWTH_MARGIN`` share; else doubled until
    it fits. (A bound on the host memory asks it before a growth: ``ColdStore.append_bytes``.)"""
    size = held
    if page is not None and needed > held:
        size = -(-needed // page) * page
        size += size // GROWTH_MARGIN // page * page
    while size < needed:
        size *= 2
    return size


def widened(old: torch.Tensor, needed: int, fill, *, pin: bool = False, spill: bool = False,
            page: int | None = None, rows_held: list[int] | None = None, room: bool = False) -> torch.Tensor:
    """``old`` [B, H, S, ...] copied into a buffer of at least ``needed`` slots (new slots hold
    ``fill``), made in the same inference mode as ``old`` (else a compiled step would see a different
    kind of tensor and compile again) and marked ``growable``. ``page``: ``needed`` rounded up to whole
    pages, plus 1 / ``GROWTH_MARGIN`` of that in whole pages (host memory: at most one partly filled page
    and a ~3% margin past what is held; a store that grew by one page at every flush was copied
    whole every P decode steps); else S doubles until it fits. ``spill``: the last column of ``old`` and of
    the result is the spill slot (``Writes``), not counted in S. ``rows_held`` [B]: the slots each row has
    written (past them a row holds ``fill``, which must then be 0): only those are copied, into a buffer
    that reads as zeros, so a row's memory follows its own length, not the longest row's. ``room``: a
    store that grows often (the cold store, the digests' codes): its buffer reserves ``ROOM`` times its
    slots of address space, and a later growth inside that is a longer view of the same memory, not a copy
    (``host_buffers.lengthened``; at ~3% a growth, copies were ~3% of a served recall load's CPU)."""
    held = old.shape[2] - spill
    size = grown_slots(held, needed, page)
    by_row = rows_held is not None and fill == 0
    with torch.inference_mode(old.is_inference()):
        longer = lengthened(old, size + spill) if room else None
        if longer is not None:
            # past the old slots the mapping was never written: zeros (the old spill slot too: a store that
            # grows never writes it, ``Writes``)
            if fill != 0:
                longer[:, :, held:] = fill
            return growable(longer)
        # (empty, then the held slots copied and only the rest filled: a store grows a page at a time, and
        # filling the whole buffer first was ~18% of a recall step's CPU at 8 rows x 1,200 tokens)
        shape = (*old.shape[:2], size + spill, *old.shape[3:])
        new = store_buffer(shape, old.dtype, old.device, pin=pin, zeroed=by_row,  # (its own mapping: see host_buffers)
                           room=(size + spill) * ROOM if room else None)
        if by_row:
            _copy_rows(new, old, rows_held)
        else:
            new[:, :, :held] = old[:, :, :held]
            new[:, :, held:] = fill
    return growable(new)


def narrowed(old: torch.Tensor, size: int, rows_held: list[int] | None = None, fill=None) -> torch.Tensor:
    """``old`` [B, H, S + 1, ...] (the last column its spill slot) cut to its first ``size`` slots and the
    spill slot, made as ``widened`` makes its buffers (a server gives back the room of a long row gone).
    ``rows_held`` with ``fill`` 0: as ``widened``'s (the spill slot, never read, is not copied)."""
    by_row = rows_held is not None and fill == 0
    with torch.inference_mode(old.is_inference()):
        shape = (*old.shape[:2], size + 1, *old.shape[3:])
        new = store_buffer(shape, old.dtype, old.device, pin=old.is_pinned(), zeroed=by_row)
        if by_row:
            _copy_rows(new, old, [min(held, size) for held in rows_held])
        else:
            new[:, :, :size] = old[:, :, :size]
            new[:, :, size:] = old[:, :, -1:]
    return growable(new)


def rows_held(count: torch.Tensor) -> list[int]:
    """[B]: the slots each row of a growable store has written, from its ``count`` [B, H] (the longest head's)."""
    return count.amax(dim=1).tolist()


def _copy_rows(new: torch.Tensor, old: torch.Tensor, rows_held: list[int]) -> None:
    """Each row's first ``rows_held[b]`` slots of ``old`` into ``new`` (a row's pages past them stay unwritten)."""
    for row, held in enumerate(rows_held):
        if held > 0:
            new[row, :, :held] = old[row, :, :held]


def best_pages(scores: torch.Tensor, page_numbers: torch.Tensor, count: int) -> torch.Tensor:
    """The absolute page numbers [B, H, k] of the ``count`` best-scoring frames (scores and page
    numbers [B, H, F]), best first; -1 where fewer frames hold a page."""
    best = kernels.top_pages(scores, count)
    return page_numbers.gather(-1, best.clamp(min=0)).masked_fill(best < 0, -1)


def tensor_bytes(tensors) -> int:
    """Bytes allocated by ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)


def frame_of(pages: torch.Tensor, frames: int | None) -> torch.Tensor:
    """Storage frame of absolute page numbers (the page itself without a limit)."""
    return pages % frames if frames is not None else pages


@dataclass
class Writes:
    """Where E appended entries [B, H, E] are written, with fixed shapes (no host read, no
    data-dependent shape: a compiled step can hold it): a valid entry at its slot (mod the ring). Every
    other entry (its row and head evicted nothing there) writes back what its target holds: in a store
    that never wraps, that row and head's next free slot (the next one its appends write), so a row's
    pages past its tokens stay unwritten however the store grows (``host_buffers.lengthened``); in a
    ring, the store's spill slot (one column past its slots, never read). One indexed write per buffer;
    duplicate targets are write-backs only."""

    slots: torch.Tensor  # [B, H, E] slot numbers of the valid entries (-1 for the others)
    target: torch.Tensor  # [B, H, E] storage slot each entry writes

    @classmethod
    def plan(cls, valid: torch.Tensor, count: torch.Tensor, ring: int | None, spill: int) -> "Writes":
        slots = append_slots(valid, count)
        if ring is None:  # (room reserved: the next free slot is at most the spill slot)
            target = torch.where(valid, slots, (count + valid.sum(dim=-1)).unsqueeze(-1))
        else:
            target = (slots % ring).masked_fill(~valid, spill)
        return cls(slots, target)

    def kept(self, new: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """``new`` [B, H, E, ...] where an entry stores something, else ``held`` (what its target holds)."""
        stored = self.slots >= 0
        return torch.where(stored.view(*stored.shape, *[1] * (new.dim() - 3)), new, held)

    def write(self, buffer: torch.Tensor, new: torch.Tensor) -> None:
        """``buffer`` [B, H, S + 1, ...] <- ``new`` [B, H, E, ...] in place (where an entry stores nothing, what
        its target holds). An ``index_put_`` by (row, head, slot), not a ``scatter_`` along the slots: torch's
        CPU scatter of half-precision rows is 20-30x slower (a flush's bf16 keys, 8 rows x 3 heads x 8 tokens
        of 64 channels: 0.33 ms against 0.011)."""
        index = self._coordinates()
        buffer.index_put_(index, self.kept(new if new.dtype == buffer.dtype else new.to(buffer.dtype), buffer[index]))

    def _coordinates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row [B, 1, 1], head [1, H, 1], target [B, H, E]): every buffer's index (made once)."""
        memo = self.__dict__.get("_index")
        if memo is None:
            batch, heads = self.target.shape[:2]
            device = self.target.device
            memo = (torch.arange(batch, device=device).view(-1, 1, 1), torch.arange(heads, device=device).view(1, -1, 1),
                    self.target)
            self.__dict__["_index"] = memo
        return memo


def pages_of(entries: torch.Tensor, g, width: int | None = None) -> torch.Tensor:
    """Summaries [B, H, K] (-1: none) of ``g`` pages each -> their pages [B, H, K * width] (-1 for a none's).
    ``g`` an int (``width`` = g), or a tensor [B, 1, 1, 1] of each row's with ``width`` its largest: a row
    of fewer pages per summary fills its last ones with -1."""
    width = g if width is None else width
    within = torch.arange(width, device=entries.device)
    pages = entries.unsqueeze(-1) * g + within
    none = (entries < 0).unsqueeze(-1)
    if not isinstance(g, int):
        none = none | (within >= g)
    return pages.masked_fill(none, -1).flatten(2)


def widened_pages(pages: torch.Tensor, width: int) -> torch.Tensor:
    """Page numbers [B, H, k] widened to ``width`` with "none" (-1): fewer candidates than that so far."""
    if pages.shape[-1] < width:
        pages = torch.nn.functional.pad(pages, (0, width - pages.shape[-1]), value=-1)
    return pages


class FirstRows:
    """``first_rows``: a part of a tier (a store, a digest, the frames) over its first rows only, for a
    decode step's choice of those rows (``RecallTier.recall``: a server's rows in use sit at the front)."""

    def first_rows(self, rows: int):
        """A shallow copy whose state tensors are views of this one's first ``rows`` rows: what it reads
        is this part's, and what it writes in place lands here."""
        view = copy.copy(self)
        view.keep_first_rows(rows)
        return view

    def keep_first_rows(self, rows: int) -> None:
        """(On the copy.) Each state tensor cut to its first ``rows`` rows; a part with host state per
        row of its own cuts that too."""
        for name, tensor in self.state_tensors().items():
            setattr(self, name, tensor[:rows])
