"""How a cache numbers each step's new tokens and re-numbers the held ones (``CacheStepping``, mixed
into ``kv.cache.H2OCache``).

Positions and token indices have one source: the cache numbers each step's new tokens once
(``position_ids``, or the first layer to attend when nobody asked: transformers' ``generate()``) from
its per-row counters, builds the step's ``StepContext`` once, and every layer records exactly those
numbers. When the next tokens would pass the model's position limit, a re-numbering maps each row's
held tokens to new positions as a function of their old ones (``kv.numbering.Renumbering``), so every
layer, head and tier agrees; RoPE keys are turned to match.
"""

from __future__ import annotations

import torch

from .numbering import PositionLimitError, Renumbering, StepContext, StepNumbers


class CacheStepping:
    """The numbering of an ``H2OCache``'s steps (its ``tokens_fed``, ``next_position``, host counters,
    ``layers``, ``kind``, ``tier``, ``rotary`` and position settings)."""

    def counters_for(self, batch: int, device) -> None:
        """Allocate the per-row counters for ``batch`` rows, if not yet (the first step, or ``allocate``)."""
        if self.tokens_fed is None or self.tokens_fed.shape[0] != batch:
            self.tokens_fed = torch.zeros(batch, dtype=torch.long, device=device)
            self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
            self.largest_next_position = 0

    def position_ids(self, batch: int, q_len: int, new_valid: torch.Tensor | None = None, device=None,
                     active: torch.Tensor | None = None) -> torch.Tensor:
        """Position ids [B, Q] for the next Q tokens, re-numbering the cache first when they would
        pass the model's limit (compact mode). Every layer records these positions for these tokens.
        Reads nothing back from the device for a step without padding.

        ``active`` [B] bool (a decode step, Q = 1; None: every row): the rows left out sit this step
        out (finished rows of a burst of decode steps, ``generation.stream``): they write nothing in
        any layer (no slot, score, decay or eviction count changes) and their ``tokens_fed`` and
        ``next_position`` stand still; their output is meaningless. Nothing is read back, so the host
        counters (``largest_next_position``, the layers' ``slots_in_use`` and
        ``tokens_fed_with_padding``) advance as if every row took part: upper bounds from then on
        (a re-numbering makes ``largest_next_position`` exact again; ``restore_host_counters`` puts
        back what they were before steps that, it turned out, fed no row at all)."""
        if active is not None and not self.masks_inactive_rows:
            raise ValueError(f"{type(self).__name__} cannot leave rows out of a step (its layers do more than write)")
        if self.largest_next_position + q_len > self.max_positions:
            self._make_room(q_len, new_valid)
        position_ids = self._begin_step(batch, q_len, new_valid, device, active).position_ids
        for layer in self.layers:  # room the tiers need for what these tokens can evict (host counters)
            if layer.is_initialized:
                layer.tier.reserve(layer.port, q_len, self.context)
        return position_ids

    def step_numbers(self, layer_idx: int, batch: int, q_len: int, new_valid, device) -> StepNumbers:
        """The current step's numbers for layer ``layer_idx``: the ones ``position_ids`` handed out,
        or, for a step nobody asked positions for (transformers' ``generate()`` passes its own
        position ids, a test driving layers by hand), the same numbers made once for all layers."""
        step = self.step
        if step is None or layer_idx <= self.step_layer or step.token_index.shape != (batch, q_len):
            step = self._begin_step(batch, q_len, new_valid, device)
        self.step_layer = layer_idx  # the deepest layer that has taken them (a shallower one asking starts anew)
        return step

    def step_context(self, layer_idx: int, batch: int, q_len: int, new_valid, device) -> StepContext:
        """``step_numbers`` with the step's mode, as layer ``layer_idx`` is handed them (built once per step)."""
        self.step_numbers(layer_idx, batch, q_len, new_valid, device)
        return self.context

    def _begin_step(self, batch: int, q_len: int, new_valid: torch.Tensor | None, device,
                    active: torch.Tensor | None = None) -> StepNumbers:
        """Number the next Q tokens of every row from the counters, and advance the counters."""
        device = device if device is not None else (self.layers[0].device if self.initialized else "cpu")
        self.counters_for(batch, device)
        with torch.inference_mode():
            if active is not None:  # a decode step some rows sit out: they take -1, like padding
                if q_len != 1 or new_valid is not None:
                    raise ValueError("rows can sit out a decode step only (one token per row, no padding)")
                left_out = ~active.view(batch, 1)
                position_ids = self.next_position.unsqueeze(1).clone()  # (the counter moves on below)
                token_index = self.tokens_fed.unsqueeze(1).masked_fill(left_out, -1)
                positions = position_ids.masked_fill(left_out, -1)
                fed = active.long()
                self.tokens_fed += fed
                self.next_position += fed
                self.largest_next_position += 1  # an upper bound: see position_ids
            elif new_valid is None:
                offsets = torch.arange(q_len, device=device).expand(batch, q_len)
                token_index = self.tokens_fed.unsqueeze(1) + offsets
                positions = position_ids = self.next_position.unsqueeze(1) + offsets
                self.tokens_fed += q_len
                self.next_position += q_len
                self.largest_next_position += q_len
            else:  # real tokens count on from the last one; padding borrows its neighbour's position id
                counted = new_valid.long().cumsum(dim=1)
                offsets = counted - 1
                token_index = (self.tokens_fed.unsqueeze(1) + offsets).masked_fill(~new_valid, -1)
                position_ids = self.next_position.unsqueeze(1) + offsets.clamp(min=0)
                positions = position_ids.masked_fill(~new_valid, -1)
                self.tokens_fed += counted[:, -1]
                self.next_position += counted[:, -1]
                # a step with padding is a prompt chunk, not the decode step: one read-back is fine here
                self.largest_next_position = int(self.next_position.max())
        self.step = StepNumbers(token_index, positions, position_ids, active)
        self.context = StepContext(self.step, self.compiled_step, self.static_shapes, self.rotary, self.tokens_fed,
                                   self.kind)
        self.step_layer = -1
        return self.step

    def _make_room(self, q_len: int, new_valid: torch.Tensor | None = None) -> None:
        """Re-number the rows whose next tokens would pass the model's limit (each row on its own
        count, ``Renumbering.rows``); the host bound that sent us here may be loose (rows left out of
        steps advance it), and then it is only made exact. One read-back."""
        due = self._rows_due(q_len, new_valid)
        if due is not None and not bool(due.any()):
            self.largest_next_position = int(self.next_position.max())
            return
        if self.position_mode == "absolute":
            raise PositionLimitError(
                f"the conversation reached the model's {self.max_positions}-position limit "
                "(use --positions compact to keep going)"
            )
        refused = self.kind.position_limit(self.max_positions)
        if refused:
            raise PositionLimitError(refused)
        largest = max(layer.capacity for layer in self.layers)
        if largest + q_len > self.max_positions:
            raise PositionLimitError(
                f"{largest} slots + {q_len} new tokens do not fit in {self.max_positions} positions: "
                "a budget of the whole window can never re-number, use a smaller --budget to go past the limit"
            )
        if self.initialized:
            self._renumber(span=min(self.max_positions - q_len, max(largest, self.max_positions // 2)), rows=due)
        self.compactions += 1

    def _rows_due(self, q_len: int, new_valid: torch.Tensor | None) -> torch.Tensor | None:
        """[B] bool: the rows whose next tokens (a padded chunk: each row's real ones) would pass the
        limit; None before the first step (no counters yet)."""
        if self.next_position is None:
            return None
        new = new_valid.sum(dim=1).to(self.next_position.device) if new_valid is not None else q_len
        return self.next_position + new > self.max_positions

    def _renumber(self, span: int, rows: torch.Tensor | None = None) -> None:
        """Give the tokens held anywhere in a row new positions below ``span``, the same in every layer
        and head (``Renumbering``: by rank among all of the row's held tokens, order kept, gaps
        closed; when a row holds more than ``span`` distinct ones, the newest span // 2 keep
        consecutive positions and the older ones share the rest in proportion). RoPE keys are rotated
        to their new positions; everything is updated in place (a CUDA graph keeps reading the same
        buffers). One read-back per re-numbering. ``rows`` [B] bool: only these rows move (None: all);
        the others keep every position, key and code bit for bit."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        if rows is not None and bool(rows.all()):
            rows = None
        with torch.inference_mode():
            renumbering = Renumbering.of(self.tokens_fed.shape[0], [(layer.positions, layer.token_index >= 0)
                                                                     for layer in layers], span, rows)
            self._apply_renumbering(renumbering, layers)
        self.largest_next_position = int(self.next_position.max())

    def _apply_renumbering(self, renumbering: Renumbering, layers: list) -> None:
        """Move every layer's held tokens to their new positions (every slot column, the tier's
        included), then the tokens each tier holds elsewhere (a cold store), with the same function."""
        for layer in layers:
            layer.renumber(renumbering, self.rotary)
        self.next_position.copy_(renumbering.next_position(self.next_position))

    def room_before_renumbering(self) -> int:
        """New tokens that fit before the next re-numbering (prefill caps its chunks to this only
        when a re-numbering is due)."""
        return self.max_positions - self.largest_next_position
