"""What a recall tier writes into its cold store and digest (``ColdWrites``, mixed into ``recall.tier.RecallTier``):
a staging page's flush, a prompt chunk's dropped tokens, tokens handed over from outside a step, and the
cold tokens' positions after a re-numbering. Eager, before a step or outside one: a decode step itself
only stages its victims (``RecallTier.archive``), and the cold store never grows inside it.

Written against the tier's parts (``cold``, ``digest``, ``staging``, ``cadence``, ``format``) and its
layer's port; every row of the tier at once, or the rows named (a flush of the rows whose pages filled).
"""

from __future__ import annotations

import contextlib

import torch

from .cold_bound import append_bytes
from .cold_keys import ColdKeys
from .step import RecallSlots
from .tier_rows import rows_kept


class ColdWrites:
    """The tier's writes into its cold store and digest (see the module)."""

    def _room(self, port, extra: int) -> None:
        """Room for ``extra`` more tokens than the longest row's cold store holds (``_needed``)."""
        needed = self._needed(port, extra)
        self.cold.reserve(needed)
        self.digest.reserve(needed)

    def _needed(self, port, extra: int) -> int:
        """The slots ``_room`` makes: ``extra`` past the longest row's count (host memory on a CPU: read; under
        zero-copy on a GPU only the bound below), and never more than every token fed so far and ``extra`` (an
        upper bound of what any row can have evicted)."""
        count, fed = self.cold.count, port.tokens_fed_with_padding
        return min(int(count.max()), fed) + extra if count.device.type == "cpu" else fed + extra

    def _kept(self, port, rows: list[int], added: torch.Tensor, extra: int) -> list[int]:
        """Of ``rows``, those whose ``added`` [B, H] tokens the cold store takes (room for ``extra`` more made
        first): all of them, unless a bound on the stores' memory (``cold_bound``) is reached; the others' tokens
        are counted as dropped (the caller lets them go)."""
        bound = self.cold.bound
        if bound is None:
            return rows
        growth, row_bytes = append_bytes(self.cold, added, self._needed(port, extra))
        held = self.cold.rows_held()
        kept = bound.admitted(self.cold, growth, {row: row_bytes[row] for row in rows}, dict(enumerate(held)))
        if len(kept) < len(rows):
            refused = torch.zeros(added.shape[0], dtype=torch.bool)
            refused[[row for row in rows if row not in kept]] = True
            self.cold.refuse(added.cpu() * refused.view(-1, 1))
        return kept

    def flush(self, port, q_len: int = 0, rows: list[int] | None = None) -> None:
        """The staging pages of ``rows`` (None: every row that staged) into the cold store and the digest
        (one append of P entries, in eviction order; the other rows append nothing), then emptied.
        Eager, before a step (or before a chunk's own drops)."""
        rows = self.cadence.staged() if rows is None else rows
        if not rows:
            return
        extra = max(self.cadence.steps[row] for row in rows) + q_len
        if self.cold.bound is not None:  # (the rows the bound refuses let their page go, as plain H2O would)
            staged = self.staging.held()
            kept = self._kept(port, rows, staged.masked_fill(~self._rows_mask(rows, staged), 0), extra)
            let_go = [row for row in rows if row not in kept]
            if let_go:
                self.staging.clear(let_go)
                self.cadence.flushed(let_go)
            rows = kept
            if not rows:
                return
            extra = max(self.cadence.steps[row] for row in rows) + q_len
        self._room(port, extra)
        slots = self.staging.slots
        token_index = slots.token_index
        every_row = len(rows) == token_index.shape[0]
        # (the exact selector's digest is the store's keys: nothing else to append)
        flushed = None if every_row else rows
        if not (isinstance(self.digest, ColdKeys) and self.staging.flushed_natively(self.cold, flushed)):
            if not every_row:
                keep = torch.zeros(token_index.shape[0], 1, 1, dtype=torch.bool, device=token_index.device)
                keep[rows] = True
                token_index = token_index.masked_fill(~keep, -1)
            self.to_cold(*self.cold_floats(slots), token_index, slots.positions)
            self.staging.clear(flushed)
        self.cadence.flushed(rows)

    @staticmethod
    def _rows_mask(rows: list[int], like: torch.Tensor) -> torch.Tensor:
        """[B, 1] bool: ``rows`` of a [B, ...] tensor ``like``."""
        mask = torch.zeros(like.shape[0], 1, dtype=torch.bool, device=like.device)
        mask[rows] = True
        return mask

    def cold_floats(self, slots: RecallSlots) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of these columns as the cold store holds them (``SlotFormat.decoded``:
        float slots as held; codes dequantized, int4 keys back in the model's frame)."""
        return self.format.decoded(slots.named(), self.cold.dtype)

    def archive_dropped(self, port, candidates: dict[str, torch.Tensor], dropped: torch.Tensor) -> None:
        # (a prefix cache's rows take decode steps only: ``_prepare`` refused its chunk)
        self.flush(port, dropped.shape[-1])  # (older than these: a padded decode step after staged ones)
        # in token order, as a cache fed one token at a time would have evicted them
        if self.cold.bound is not None:  # (what the bound refuses is dropped, as plain H2O drops it)
            rows = list(range(dropped.shape[0]))
            kept = self._kept(port, rows, dropped.sum(dim=-1), dropped.shape[-1])
            if len(kept) < len(rows):
                dropped = dropped & self._rows_mask(kept, dropped).unsqueeze(-1)
            if kept:  # (the chunk's room, made here where the bound admitted it)
                self._room(port, dropped.shape[-1])
        token_index = candidates["token_index"].masked_fill(~dropped, -1)
        # the dropped first, in token order; only as many columns as the row that dropped most (the others,
        # token index -1, would be skipped by the store): a chunk drops about its length, of slots + chunk columns
        most = int(dropped.sum(dim=-1).amax()) if dropped.numel() else 0
        if most == 0:
            return
        order = token_index.masked_fill(~dropped, torch.iinfo(torch.long).max).argsort(dim=-1)[..., :most]

        def take(t):
            return t.gather(2, order if t.dim() == 3 else order.unsqueeze(-1).expand(*order.shape, t.shape[-1]))

        taken = {name: take(candidates[name]) for name in self.format.tensor_names}
        keys, values = self.format.decoded(taken, self.cold.dtype)  # (codes and scales: their floats)
        self.to_cold(keys, values, take(token_index), take(candidates["positions"]))

    def to_cold(self, keys, values, token_index, positions) -> None:
        """Evicted tokens [B, H, N, ...] (token index -1: none) into the cold store and the digest."""
        self.cold.append(keys, values, token_index, positions, reserve=False)
        self.digest.append(keys, token_index, reserve=False)

    def take_cold(self, keys, values, token_index, positions) -> None:
        """Tokens handed to the cold tier from outside a step (``recall.synthetic``), room made as they come."""
        self.cold.append(keys, values, token_index, positions)
        self.digest.append(keys, token_index)

    def renumber(self, port, renumbering, rotary) -> None:
        renumbering = renumbering.widened(self.batch)  # (a prefix cache's first rows: the others keep theirs)
        self.cold.renumber(renumbering)  # (the staging page moved with the layer's slots)
        if rotary is not None:  # the digest scores keys as they will be attended: at their new positions
            keys = self.cold.keys_by_slot(rotary)  # (quantized slots: as the page will come back, encoded anew)
            # rows that did not move keep their digest as appended (a rebuild could round it otherwise)
            moved = renumbering.rows
            written = self.cold if isinstance(self.digest, ColdKeys) else self.digest  # (the exact digest writes the store)
            with rows_kept(written, ~moved) if moved is not None else contextlib.nullcontext():
                self.digest.rebuild(self.format.held_keys(keys))
