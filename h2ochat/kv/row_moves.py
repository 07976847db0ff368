"""Batch rows moved one at a time, the other rows untouched: a row's state copied out
(``export_row``) and back into a row of another cache (``import_row``: a server parks a finished
conversation in host memory and brings it back), a row emptied (``reset_row``) and a synthetic
context (``assume_seen``). ``H2OCache`` takes these from ``RowMoves``; they work on its layers'
``state_tensors()`` and its per-row counters only."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .rows import CacheShapeError, RowState
from .synthetic import fill_recent


class RowMoves:
    """What ``H2OCache`` does to one batch row (``layers``, ``tokens_fed``, ``next_position``,
    ``largest_next_position``)."""

    def export_row(self, row: int, device="cpu", *, copy: bool = True) -> RowState:
        """A copy of batch row ``row``'s state in every layer (on ``device``): the layer's slot tensors
        and its tier's (``Tier.export_row``: a store that grows with the text keeps what this row holds).
        ``copy=False``: views of this cache's tensors where they are (``device`` unused), for a cache that
        is imported from and then dropped (a server's 1-row prefill cache: one copy of its state, not two), or
        a row moved within this cache (``move_row``)."""
        if not self.initialized:
            raise CacheShapeError("the cache holds nothing yet: nothing to export")

        def taken(tensor):
            return tensor.to(device, copy=True) if copy else tensor

        layers = [{**{name: taken(tensor[row]) for name, tensor in layer.own_state_tensors().items()},
                   **layer.tier.export_row(row, device, copy=copy)} for layer in self.layers]
        counters = {name: taken(tensor[row]) for name, tensor in self._row_counters().items()}
        return RowState(layers, counters)

    def _row_counters(self) -> dict[str, torch.Tensor]:
        return {"tokens_fed": self.tokens_fed, "next_position": self.next_position}

    def import_row(self, row: int, state: RowState, moved_from: int | None = None) -> None:
        """Overwrite batch row ``row`` with ``state`` (exported from a cache of the same layer count,
        capacities, heads, dtype and tier), in place: the other rows, mid-generation or not, are
        untouched and a compiled step's buffers keep their addresses (a tier's store may grow: ``Tier.import_row``).
        The row then continues exactly as its own cache would have (until a re-numbering, which every row takes).
        ``moved_from``: the row of this cache ``state`` was exported from, for a move (``move_row``)."""
        if not self.initialized:
            raise CacheShapeError("allocate the cache (H2OCache.allocate) before importing a row into it")
        if len(state.layers) != len(self.layers):
            raise CacheShapeError(f"the row state has {len(state.layers)} layers, the cache {len(self.layers)}")
        # the layers' own tensors and the counters are checked here, the rest goes to each layer's tier
        targets = [(f"layer {index}", layer.own_state_tensors(), saved)
                   for index, (layer, saved) in enumerate(zip(self.layers, state.layers))]
        targets.append(("counters", self._row_counters(), state.counters))
        for (where, mine, saved), layer in zip(targets, [*self.layers, None]):
            tier_names_allowed = layer is not None and bool(layer.tier.state_tensors())  # (its tier checks them)
            if not set(mine) <= set(saved) or (set(saved) != set(mine) and not tier_names_allowed):
                raise CacheShapeError(f"{where}: the row state holds {sorted(saved)}, the cache {sorted(mine)} and its tier's")
            for name, tensor in mine.items():
                if saved[name].shape != tensor.shape[1:] or saved[name].dtype != tensor.dtype:
                    raise CacheShapeError(f"{where} {name}: the row state's {tuple(saved[name].shape)} "
                                          f"{saved[name].dtype} does not fit the cache's {tuple(tensor.shape[1:])} "
                                          f"{tensor.dtype}")
        with torch.inference_mode():  # the slots were made under inference mode
            for _, mine, saved in targets:
                for name, tensor in mine.items():
                    tensor[row].copy_(saved[name])
            for (_, mine, saved), layer in zip(targets, self.layers):
                layer.tier.import_row(row, {name: tensor for name, tensor in saved.items() if name not in mine}, moved_from)
        # the host counters cover every row: slot columns in use and columns fed take the larger; in a cache
        # of one row the row imported is every row, so they become its own (as in a cache made for it: a
        # server reuses its prompt's 1-row cache for the next resumed conversation)
        alone = self.tokens_fed.shape[0] == 1
        for layer, saved in zip(self.layers, state.layers):  # (of the policy's columns: a tier's are its own)
            occupied = (layer.port.policy_part(saved["token_index"]) >= 0).any(dim=0).nonzero()
            in_use, fed = (0, 0) if alone else layer.host_counters()
            layer.set_host_counters(max(in_use, int(occupied.max()) + 1 if occupied.numel() else 0),
                                    max(fed, state.tokens_fed))
        self.largest_next_position = max(0 if alone else self.largest_next_position,
                                         int(state.counters["next_position"]))

    def move_row(self, source: int, target: int) -> None:
        """Row ``source`` into row ``target`` (a server packing its rows in use at the front), ``source`` then
        emptied: the row goes on exactly as it would have in ``source`` (a tier's host clocks move with it,
        and a recall tier's staging page is not folded into its cold store as a resumed conversation's is).
        Copied row to row: ``source``'s state is read in place (two rows of one tensor never overlap; a store
        that grows on the way keeps the buffer those views read), where a copy out and back wrote it twice,
        the first time into fresh host buffers and their page faults (a recall row: ~1.5 s of a served chat
        load's ~95)."""
        self.import_row(target, self.export_row(source, copy=False), moved_from=source)
        self.reset_row(source)

    def reset_row(self, row: int) -> None:
        """Empty batch row ``row`` (no tokens, scores and counters 0) without touching the others."""
        if not self.initialized:
            return
        with torch.inference_mode():
            for layer in self.layers:
                layer.reset_row(row)
            for tensor in self._row_counters().values():
                tensor[row] = 0
        # one read-back (rows are reset rarely): the bound is the largest next position left
        self.largest_next_position = int(self.next_position.max())

    def assume_seen(self, tokens: int, generator: torch.Generator) -> None:
        """Make an initialised cache look as if every row had been fed ``tokens`` tokens (a benchmark's
        synthetic context: a decode step costs the same whatever the values it reads): each layer
        holds its most recent ``min(capacity, tokens)`` tokens with random keys, values and scores,
        drawn by ``generator`` (on the slots' device)."""
        with torch.inference_mode():
            for layer in self.layers:
                fill_recent(layer, tokens, generator)
            self.tokens_fed.fill_(tokens)
            self.next_position.fill_(tokens)
        self.largest_next_position = tokens

    def reset_rows(self, rows: Sequence[int]) -> None:
        """Empty batch rows ``rows`` (``reset_row``). In a cache whose decode steps feed every row (one
        that cannot leave rows out: a cold tier), the layers' count of columns fed, which every step
        of every row grows and by which a tier reserves its stores' room, comes back to the largest
        row's tokens fed: the stores grow with the longest conversation held, not with the uptime."""
        for row in rows:
            self.reset_row(row)
        if not self.initialized or (self.masks_inactive_rows and not self.tier.columns):
            return
        fed = int(self.tokens_fed.max())
        for layer in self.layers:
            in_use, counted = layer.host_counters()
            if counted > fed:
                layer.set_host_counters(in_use, fed)
