"""One recall tier's row moved between caches (``RecallRowMoves``, mixed into ``recall.tier.RecallTier``):
a server parks a finished conversation in host memory and imports it into a row again when it comes
back (``kv.tier``'s ``export_row``/``import_row``, called by ``H2OCache.export_row``/``import_row``).

Written against the stores' public state only (``state_tensors``, ``count``, ``capacity``,
``reserve``): a store whose slot dimension is its ``capacity`` plus the spill slot grows with the
text, and a row keeps of it the slots its tokens reach; every other tensor goes whole. After an
import the staging page is folded into the cold store (``_fold_staged``), so the row's page fills
as its own cache's would. ``rows_kept``: some rows of a part's state held through an update of every
row (a choice some rows do not take, a re-numbering some rows do not undergo).
"""

from __future__ import annotations

import contextlib

import torch

from ..host_buffers import fill_empty, store_buffer


@contextlib.contextmanager
def rows_kept(part, still: torch.Tensor):
    """The rows ``still`` [B] bool of ``part``'s state tensors (``state_tensors``) come out of the block
    as they went in: an update of every row that only some rows should take."""
    kept = {name: tensor[still.to(tensor.device)].clone() for name, tensor in part.state_tensors().items()}
    yield
    for name, tensor in part.state_tensors().items():
        tensor[still.to(tensor.device)] = kept[name]


def _copied(tensor: torch.Tensor, device) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``; in host memory, a large one in a buffer of its own (a parked
    conversation's stores are freed when it comes back: ``host_buffers``)."""
    if torch.device(device).type != "cpu":
        return tensor.to(device, copy=True)
    copy = store_buffer(tuple(tensor.shape), tensor.dtype)
    copy.copy_(tensor)
    return copy


class RecallRowMoves:
    """Export and import of one row of a ``RecallTier`` (its ``cold``, ``digest``, ``frames``,
    ``staging``, ``cadence``, ``page_means``, ``state_tensors``, ``empty_value`` and ``to_cold``); and the
    reset of a row."""

    def reset_row(self, row: int) -> None:
        """Row ``row`` was emptied (its state tensors hold their empty values): its clock starts again."""
        if self.cold is not None:
            self.cadence.flushed([row])
            self.page_means.forget(row)
            self._digest_state_written()
            count = self.cold.count  # the cold store gives back what only a longer conversation needed
            if count.device.type == "cpu":
                self.cold.fit(int(count.max()) + self.cold.page)
            self.cold.note_written()  # (the row's bytes went back: a bound on the stores' memory has them again)

    def _digest_state_written(self) -> None:
        """The digest's state was written from outside it (a row reset or imported): it reads its host copies
        again (a two-stage digest's per-row scale)."""
        written = getattr(self.digest, "state_written", None)
        if written is not None:
            written()

    def _row_extents(self, row: int, state: dict[str, torch.Tensor]) -> dict[str, int]:
        """Slot columns row ``row`` uses, by state name (``state``: the tier's ``state_tensors``), in the
        stores that grow with the text."""
        names = {id(tensor): name for name, tensor in state.items()}
        extents = {}
        for part in (self.cold, self.digest):
            capacity, count = getattr(part, "capacity", None), getattr(part, "count", None)
            if capacity is None or count is None:
                continue
            held = min(int(count[row].max()), capacity)
            for tensor in part.state_tensors().values():
                if tensor.dim() >= 3 and tensor.shape[2] == capacity + 1 and id(tensor) in names:
                    extents[names[id(tensor)]] = held
        return extents

    def _part_names(self, state: dict[str, torch.Tensor], part, *wanted: str) -> list[str | None]:
        """The state names (in ``state``, the tier's ``state_tensors``) of ``part``'s own tensors ``wanted``
        (None where it has none of that name)."""
        names = {id(tensor): name for name, tensor in state.items()}
        own = part.state_tensors()
        return [names.get(id(own[name])) if name in own else None for name in wanted]

    def _settle(self) -> None:
        """Host code reads or writes the cold store's buffers: wait for zero-copy kernels still on them."""
        if self.cold.zero_copy and self.cold.device.type == "cuda":
            torch.cuda.synchronize(self.cold.device)

    def export_row(self, row: int, device="cpu", copy: bool = True) -> dict[str, torch.Tensor]:
        """Row ``row``'s state (``state_tensors`` names) on ``device``: the growing stores cut to the
        slots the row's tokens reach, so a parked row costs what it holds, not the batch's capacity
        (``copy=False``: views of them where they are)."""
        if self.cold is None:
            return {}
        self._settle()
        state = self.state_tensors()
        extents = self._row_extents(row, state)
        taken = (lambda tensor: _copied(tensor, device)) if copy else (lambda tensor: tensor)
        return {name: taken(tensor[row, :, :extents[name]] if name in extents else tensor[row])
                for name, tensor in state.items()}

    def import_row(self, row: int, state: dict[str, torch.Tensor], moved_from: int | None = None) -> None:
        """Overwrite row ``row`` with ``state`` (``export_row`` of a tier of the same settings): the
        stores grow to take its tokens, their slots past them are emptied, and so is a tensor the state
        lacks (nothing of the row's last conversation stays behind). A conversation resumed folds its
        staging page into its cold store (``_fold_staged``); a running row moved within the tier
        (``moved_from``: the row it was in) keeps its page and its clock."""
        if self.cold is None:
            raise ValueError("the recall tier is not allocated: nothing to import into")
        self._settle()
        if "last_query" in state and getattr(self, "last_query", None) is None:  # (made by a tier's first step)
            self.last_query = torch.zeros(self.recalled_mass.shape[0], *state["last_query"].shape,
                                          dtype=state["last_query"].dtype, device=self.recalled_mass.device)
        own = self.state_tensors()
        unknown = set(state) - set(own)
        if unknown:
            raise ValueError(f"the row state holds recall tensors this tier has not: {sorted(unknown)}")
        counts = [name for part in (self.cold, self.digest) for name in self._part_names(own, part, "count") if name]
        needed = max((int(state[name].max()) for name in counts if name in state), default=0)
        page = self.cold.page  # (room for a staged page too: ``_fold_staged``)
        self.cold.reserve(needed + page)  # (growing replaces the stores' tensors: read them after)
        self.digest.reserve(needed + page)
        own = self.state_tensors()  # (read again: growing replaced the stores' tensors)
        for name, tensor in own.items():
            target = tensor[row]
            saved = state.get(name)
            if saved is None:
                target.fill_(self.empty_value(name))
                continue
            fits = saved.dtype == target.dtype and saved.dim() == target.dim() and (
                saved.shape == target.shape or (target.dim() >= 2 and saved.shape[:1] + saved.shape[2:]
                                                == target.shape[:1] + target.shape[2:]))
            if not fits:
                raise ValueError(f"recall tier {name}: the row state's {tuple(saved.shape)} {saved.dtype} does not "
                                 f"fit the tier's {tuple(target.shape)} {target.dtype}")
            held = min(saved.shape[1], target.shape[1]) if target.dim() >= 2 else None
            target[:, :held].copy_(saved[:, :held]) if held is not None else target.copy_(saved)
            if held is not None and held < target.shape[1]:  # (past a row's tokens a store holds nothing)
                for head in target[:, held:].unbind(0):  # (each head's tail is one block: emptied, its pages go back)
                    fill_empty(head, self.empty_value(name))
        alone = self.cold.count.shape[0] == 1  # (the row is every row: the tier's flags become its own)
        had_query = getattr(self, "has_query", False) and not alone
        self.has_query = had_query or "last_query" in state  # (its next step recalls)
        self._digest_state_written()
        self.page_means.forget(row)  # (its values are another conversation's)
        if alone:  # (re-marked below when its tokens were re-numbered)
            self.cold.forget_renumbering()
        positions, encoded = self._part_names(own, self.cold, "positions", "encoded")
        if positions and encoded and not self.cold.moved and bool((state[positions] != state[encoded]).any()):
            self._mark_moved()
        if moved_from is None:
            self._fold_staged(row)
        else:
            self.cadence.moved(moved_from, row)
        self.cold.note_written()

    def _fold_staged(self, row: int) -> None:
        """After an import: the imported row's staging page (it came with the layer's slots) goes to its
        cold store and digest, in eviction order, and its page and cadence start again, as its own
        cache's do after a prompt chunk (which flushes): a conversation resumed in a batch stages as it
        would alone. The other rows' pages are left alone (each row flushes on its own count)."""
        staging = getattr(self, "staging", None)
        if staging is None:
            return
        slots = staging.slots
        if bool((slots.token_index[row] >= 0).any()):  # (a host read, once per import)
            room = int(self.cold.count[row].max()) + self.cold.page
            self.cold.reserve(room)
            self.digest.reserve(room)
            keep = torch.zeros(slots.token_index.shape[0], 1, 1, dtype=torch.bool, device=slots.token_index.device)
            keep[row] = True
            self.to_cold(*self.cold_floats(slots), slots.token_index.masked_fill(~keep, -1), slots.positions)
        staging.clear([row])
        self.cadence.flushed([row])

    def _mark_moved(self) -> None:
        """The imported row's cold tokens were re-numbered: brought-back keys must be rotated from their
        encoded positions. An append of nothing with ``encoded`` given sets the store's flag (it writes back
        what the store holds: the store's public route)."""
        cold = self.cold
        batch, heads = cold.count.shape
        nothing = torch.full((batch, heads, 1), -1, dtype=torch.long)
        cold.append(torch.zeros(batch, heads, 1, cold.keys.shape[-1], dtype=cold.dtype),
                    torch.zeros(batch, heads, 1, cold.values.shape[-1], dtype=cold.dtype), nothing, nothing,
                    encoded=nothing, reserve=False)
