"""The recall step: the best pages of each (sequence, KV head) into its R recall slots.

The recall slots are F = R // P - 1 frames of P slots and the staging page (below). Each step the selector's page scores name up to
``want`` <= F pages; pages already in a frame stay where they are (nothing is copied), the missing
ones replace the frames used longest ago (a small LRU: with F > want a page that drops out of the
top for a step or two is still there when it comes back). Everything is tensor ops on the scores'
device: no value is read back to the host, so a step can be queued (or captured in a graph) without
waiting for the device.

On a CPU the cold store is in the same memory: the copy happens inside the step, which reads
nothing back (tests/test_recall_compiled.py) and compiles. On a GPU the cold store is pinned host
memory, and where the driver maps it into the GPU's address space (``ColdStore.zero_copy``, probed
once) the eviction's append and the pages' gather are Triton kernels reading and writing it over the
bus on the step's stream (``kernels/triton_rows.py``): the step still reads nothing back and the
recalled page is attended by the step that chose it. Where the probe fails, the step falls back to
ordinary copies and waits for the device twice per layer (the evicted token device -> host, the
plan's frame numbers to the host). Neither route has run on a GPU yet (tests: the kernels under the
Triton interpreter, tests/test_recall_zero_copy.py); ``benchmarks/gpu_check.py`` times it.

The staging page (``StagingPage``). A decode step evicts at most one token per (sequence, KV
head). Appending it to the cold store and the digest on every step (an index plan, a scatter per buffer, a quantisation) cost more ops than
the rest of the layer's step, so the victim is written into the next column of the staging page
instead (one gather and one write per slot tensor, and a count) and the whole page goes to the cold
store and the digest at once when it is full (``RecallTier.flush``: one append of P tokens every P
decode steps, decided on the host, before a step).

The staging columns are the last P of the tier's R recall columns: part of the device budget, and
attended like every slot whose token index is >= 0. So a staged token is never out of reach: the
newest evicted tokens (fewer than P + 1) are attended exactly, and the pages the selector chooses
from are the flushed ones. The cold store receives the same tokens in the same order as a per-token
append would (the staging order is the eviction order; a victim that was an empty slot has token
index -1 and is skipped by the append), so after a flush it holds exactly what the per-token tier
holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2ochat_kernels.cpu import recall_ops as native
from h2ochat_kernels.cpu import store_ops as native_store
from .layout import FirstRows


@dataclass
class RecallPlan:
    frame_page: torch.Tensor  # [B, H, F] page held by each frame after the step (-1: empty)
    load: torch.Tensor  # [B, H, F] bool: the frame gets a new page this step (copy it in)


class RecallFrames(FirstRows):
    """Which cold page sits in each recall frame, per (sequence, KV head)."""

    def __init__(self, batch: int, heads: int, frames: int, device=None):
        self.frame_page = torch.full((batch, heads, frames), -1, dtype=torch.long, device=device)
        self.last_used = torch.zeros(batch, heads, frames, dtype=torch.long, device=device)
        self.clock = torch.zeros(batch, heads, 1, dtype=torch.long, device=device)  # recalls so far
        self.copied = torch.zeros(batch, heads, dtype=torch.long, device=device)  # pages loaded so far
        # the frame's page was full when it was loaded (a page still filling is loaded again)
        self.complete = torch.zeros(batch, heads, frames, dtype=torch.bool, device=device)

    def update(self, wanted: torch.Tensor, complete_pages: torch.Tensor | None = None) -> RecallPlan:
        """``wanted`` [B, H, k] page numbers, best first (-1: none), k <= F. ``complete_pages`` [B, H]:
        pages 0..n-1 are full (None: all are); a frame holding a page that was still filling when it
        was loaded is loaded again (it may have grown). Returns the plan."""
        frames = self.frame_page.shape[-1]
        if wanted.shape[-1] > frames:
            raise ValueError(f"{wanted.shape[-1]} pages wanted but only {frames} recall frames")
        if host_reads_allowed(self.frame_page):  # the same plan in one C call (``native``), where it runs
            load = native.frames_update(wanted, self.frame_page, self.last_used, self.clock, self.copied,
                                        self.complete, complete_pages)
            if load is not None:
                return RecallPlan(self.frame_page.clone(), load)
        self.clock += 1
        real = wanted >= 0
        match = (self.frame_page.unsqueeze(-1) == wanted.unsqueeze(-2)) & real.unsqueeze(-2)  # [B, H, F, k]
        kept = match.any(dim=-1)  # frame holds a wanted page
        missing = real & ~match.any(dim=-2)  # [B, H, k] wanted page in no frame
        # free frames, least recently used first (empty frames have last_used 0 and come first)
        big = torch.iinfo(torch.long).max
        order = self.last_used.masked_fill(kept, big).argsort(dim=-1, stable=True)  # [B, H, F]
        # the j-th missing page (in wanted order) goes to the j-th free frame
        rank = missing.long().cumsum(dim=-1) - 1  # [B, H, k]
        target = order.gather(-1, rank.clamp(min=0))  # [B, H, k] frame for each missing page
        target = target.masked_fill(~missing, frames)  # the others write into a spare column
        spare = (*kept.shape[:-1], frames + 1)
        load = torch.zeros(spare, dtype=torch.bool, device=kept.device).scatter_(-1, target, missing)[..., :frames]
        new_page = torch.full(spare, -1, dtype=torch.long, device=kept.device)
        new_page = new_page.scatter_(-1, target, wanted)[..., :frames]
        # (in place: a compiled step updates these buffers where they are)
        self.frame_page.copy_(torch.where(load, new_page, self.frame_page))
        self.last_used.copy_(torch.where(kept | load, self.clock, self.last_used))
        self.copied += load.sum(dim=-1)
        if complete_pages is not None:
            load = load | (~self.complete & (self.frame_page >= 0))
            self.complete.copy_(torch.where(load, self.frame_page < complete_pages.unsqueeze(-1), self.complete))
        return RecallPlan(self.frame_page.clone(), load)

    def tick(self, rows: bool | list[bool] = True) -> None:
        """What ``update`` does when no page is wanted anywhere: the clock of ``rows`` (True: every row) advances."""
        if rows is True:
            self.clock += 1
        else:
            self.clock += torch.tensor(rows, device=self.clock.device).view(-1, 1, 1).long()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"frame_page": self.frame_page, "last_used": self.last_used, "clock": self.clock,
                "copied": self.copied, "complete": self.complete}


@dataclass
class RecallSlots:
    """The R recall slots of one layer: keys, values, token index and position per (sequence, KV
    head), frame f covering slots [f*P, (f+1)*P). On the CPU these can be views of the layer's last R
    slot columns, so the attention reads them with the hot slots in one softmax."""

    keys: torch.Tensor  # [B, H, R, D]
    values: torch.Tensor  # [B, H, R, Dv]
    token_index: torch.Tensor  # [B, H, R] (-1: empty)
    positions: torch.Tensor  # [B, H, R]
    # quantized slots (``kv.slot_format``): keys and values are codes, these their per-slot scales and
    # offsets ({name: [B, H, R]}); None for float slots
    scales: dict[str, torch.Tensor] | None = None

    @classmethod
    def of(cls, columns: dict[str, torch.Tensor], slot_format) -> "RecallSlots":
        """From a tier port's named columns (``TierPort.tier_columns``) of a layer in ``slot_format``."""
        scales = {name: columns[name] for name in slot_format.tensor_names if name not in ("keys", "values")}
        return cls(columns["keys"], columns["values"], columns["token_index"], columns["positions"], scales or None)

    def named(self) -> dict[str, torch.Tensor]:
        """The slot format's tensors by name (keys, values and any scales)."""
        return {"keys": self.keys, "values": self.values, **(self.scales or {})}

    def columns(self) -> dict[str, torch.Tensor]:
        """Every per-slot tensor by name: the slot format's (``named``), the token indices and positions."""
        return {**self.named(), "token_index": self.token_index, "positions": self.positions}

    def first_rows(self, rows: int) -> "RecallSlots":
        """These slots of the first ``rows`` rows (views)."""
        scales = {name: tensor[:rows] for name, tensor in self.scales.items()} if self.scales else None
        return RecallSlots(self.keys[:rows], self.values[:rows], self.token_index[:rows], self.positions[:rows], scales)


def fill_recall_slots(slots: RecallSlots, store, plan: RecallPlan, rotary=None, slot_format=None) -> None:
    """Copy the pages the plan loads from the cold store into their frames (frames that keep their
    page are not touched). Keys come back rotated to the tokens' current positions; quantized slots
    (``slot_format``) take them encoded as the layer's new tokens are (codes and scales)."""
    if host_reads_allowed(plan.load):
        if store.fill_frames(slots.columns(), plan, rotary):
            return  # (float slots or 8-bit codes: one C call, ``native.fill_frames``)
        _fill_loaded_frames(slots, store, plan, rotary, slot_format)
        return
    page = store.page
    wanted = plan.frame_page.masked_fill(~plan.load, -1)  # [B, H, F]: only the frames that change
    keys, values, token_index, positions = store.pages(wanted.to(store.count.device), rotary)  # [B, H, F*P, ...]
    change = plan.load.unsqueeze(-1).expand(*plan.load.shape, page).flatten(2).to(slots.token_index.device)  # [B, H, F*P]
    device = slots.keys.device
    keys, values = keys.to(device), values.to(device)
    if slots.scales is not None:  # (the cold store holds the dequantized floats: the same codes come back)
        stored = slot_format.encode(keys, values)
        keys, values = stored["keys"], stored["values"]
        for name, buffer in slots.scales.items():
            buffer.copy_(torch.where(change, stored[name], buffer))
    slots.keys.copy_(torch.where(change.unsqueeze(-1), keys.to(slots.keys.dtype), slots.keys))
    slots.values.copy_(torch.where(change.unsqueeze(-1), values.to(slots.values.dtype), slots.values))
    slots.token_index.copy_(torch.where(change, token_index.to(device), slots.token_index))
    slots.positions.copy_(torch.where(change, positions.to(device), slots.positions))


def host_reads_allowed(state: torch.Tensor) -> bool:
    """Whether the recall step may read ``state`` on the host: an eager step with it in CPU memory
    (no device to wait for). There the step reads its plan (most decode steps load no page or one or
    two: copying only those frames beats rewriting every recall column, ``torch.where`` over all R,
    every step) and skips choosing while the cold store is empty. A GPU's step and a compiled graph
    read nothing back (tests/test_recall_compiled.py holds both routes to that, this one switched off)."""
    return state.device.type == "cpu" and not torch.compiler.is_compiling()


def _fill_loaded_frames(slots: RecallSlots, store, plan: RecallPlan, rotary, slot_format) -> None:
    """``fill_recall_slots`` for a plan read on the host: the loaded pages only, each read from the store
    by (row, head, page) and written into its frame's columns (one read and one write a buffer)."""
    row, head, frame = plan.load.nonzero(as_tuple=True)
    if row.numel() == 0:
        return
    page = store.page
    keys, values, token_index, positions = store.page_tokens(row, head, plan.frame_page[row, head, frame], rotary)
    new = {"keys": keys, "values": values, "token_index": token_index, "positions": positions}
    targets = slots.columns()  # (with any scales)
    if slots.scales is not None:  # (the cold store holds the dequantized floats: the same codes come back)
        new.update(slot_format.encode(keys, values))
    columns = frame.unsqueeze(-1) * page + torch.arange(page, device=frame.device)  # [N, P]
    rows, heads = row.unsqueeze(-1), head.unsqueeze(-1)
    for name, buffer in targets.items():
        buffer[rows, heads, columns] = new[name].to(buffer.device, buffer.dtype)


class StagingPage:
    """P staging columns of one layer (views of its slots) and the count of entries per (sequence, head)."""

    def __init__(self, slots: RecallSlots, device):
        self.slots = slots
        self.page = slots.token_index.shape[-1]
        batch, heads = slots.token_index.shape[:2]
        self.count = torch.zeros(batch, heads, dtype=torch.long, device=device)  # entries written since the flush
        self.steps = 0  # host: decode steps since the flush (an upper bound of ``count``)
        self._flusher = "unmade"  # (``flushed_natively``'s C flush of these columns: made at the first, or None)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"count": self.count}

    def put(self, port, victim: dict[str, torch.Tensor], active: torch.Tensor | None = None) -> None:
        """One entry per (sequence, head) [B, H, ...] into the next staging column (fixed shapes, no
        host read: a compiled step holds it): ``victim`` by name (``TierPort.victims``: keys, values,
        token_index, positions and, for quantized slots, the scales beside the codes), written by index into
        the layer's own tensors (``TierPort.write_staged``: a compiled step's write into the page's views
        would copy them whole). ``active`` [B] bool (None: every row): a row left out writes an empty entry
        and does not count it."""
        # (a prefix cache's step: its first rows, ``H2OCache.prefix``; cut whatever the rows, so a compiled
        # step of a symbolic batch holds no branch on its size)
        count = self.count[: victim["token_index"].shape[0]]
        port.write_staged(self.page, count, victim)
        count.add_(1 if active is None else active.view(-1, 1).long())

    def count_step(self) -> None:
        """A decode step is about to run: it may stage one entry (host counter)."""
        self.steps += 1

    def full(self) -> bool:
        """Whether the next decode step could write past the page (host counter)."""
        return self.steps >= self.page

    def held(self) -> torch.Tensor:
        """[B, H]: real tokens staged now."""
        return (self.slots.token_index >= 0).sum(dim=-1)

    def flushed_natively(self, cold, rows: list[int] | None) -> bool:
        """The flush of ``rows`` (None: every row) into ``cold`` (room reserved) in one C call, the columns then
        cleared (``native_store.Flusher``: float columns on a CPU, a store the C append takes); False, having
        done nothing, where it does not run (the caller's torch route then)."""
        if torch.compiler.is_compiling() or self.slots.scales is not None or not cold.appends_natively():
            return False
        if self._flusher == "unmade":
            self._flusher = native_store.Flusher.of(self.slots.columns(), self.count, cold.named_buffers(), cold.count)
        chosen = None if rows is None else set(rows)
        mask = None if chosen is None else [row in chosen for row in range(self.count.shape[0])]
        if self._flusher is None or not self._flusher(cold.named_buffers(), cold.count, cold.capacity, mask):
            return False
        self.clear(rows, columns_emptied=True)
        return True

    def clear(self, rows: list[int] | None = None, *, columns_emptied: bool = False) -> None:
        """After a flush: the columns of ``rows`` (None: every row) hold nothing (token index -1: not attended).
        ``columns_emptied``: the flush's kernel emptied them and zeroed their counts (``native_store.Flusher``)."""
        if rows is None:
            self.steps = 0
        if columns_emptied:
            return
        if rows is None:
            self.slots.token_index.fill_(-1)
            self.slots.positions.fill_(-1)
            self.count.zero_()
            return
        self.slots.token_index[rows] = -1
        self.slots.positions[rows] = -1
        self.count[rows] = 0

    def nbytes(self) -> int:
        """Device bytes beyond the slots it lives in: the count."""
        return self.count.numel() * self.count.element_size()
