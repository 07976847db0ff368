"""How a layer chooses and writes its victims (``LayerEviction``, mixed into ``kv.layer.H2OLayer``).

A decode step overwrites each (sequence, KV head)'s lowest-priority slot in place, by a route chosen
once at allocation (``choose_eviction``): a tier that archives, or a slot format the backend's
eviction kernels do not write (``SlotFormat.fused_writes``), takes the victim chosen once here and
written by ``reference.write_slots`` beside the format's own per-slot tensors; a built-in rank goes
through the backend's ``evict_by_policy`` (one Triton launch on CUDA, the tested reference on the
CPU); a rank of its own (random) or rows of different budgets through a priority computed here. A
multi-token step keeps the best ``capacity`` of slots and new tokens (``_select``). The tier sees
each victim before it goes (``Tier.archive``, ``Tier.archive_dropped``), through the layer's port.
"""

from __future__ import annotations

import torch

import h2ochat_kernels as kernels
from h2ochat_kernels import reference


class LayerEviction:
    """The eviction of an ``H2OLayer`` (its slots, ``rows``, ``kernels``, ``format``, ``tier``, ``port``)."""

    def choose_eviction(self):
        """The steady-state eviction for this layer's kernels, policy, format and tier: a function of
        the layer (the class's, not a bound method: a layer holding a method of its own is a reference
        cycle, freed only when Python's cycle collector runs, and a server's prompt caches piled up
        until it did)."""
        kind = type(self)
        if self.tier.archives or not self.format.fused_writes:
            return kind._evict_to_tier
        if self.fused_eviction_parameters is not None and not self.rows.spare_slots:
            return kind._evict_fused
        return kind._evict_by_priority

    def priority(self, scores, token_index, newest, value_norm) -> torch.Tensor:
        """Keep priority [B, Hkv, S] of every slot (higher = keep): each row by its policy (a built-in
        rank every row shares straight from the kernels' reference, as the fused eviction computes it)."""
        parameters = self.fused_eviction_parameters
        if parameters is not None:
            rank = reference.slot_rank(scores, token_index, newest, value_norm, **parameters)
        else:
            rank = self.row_policies.rank(scores, token_index, newest, value_norm, self.rows)
        priority = kernels.keep_priority(rank, token_index, newest, self.rows.recent, self.rows.sinks)
        if self.rows.spare_slots:  # a row holding its own budget leaves the spare slots alone
            full = (token_index >= 0).sum(dim=-1, keepdim=True) >= self.rows.slots.view(-1, 1, 1)
            priority = priority.masked_fill((token_index < 0) & full, float("inf"))
        return priority

    # -- steady decoding: overwrite the lowest-priority slot of each (sequence, head) in place ---------
    def evict_one(self, key, value, new_score, token_index, position, value_norm, active=None) -> None:
        """Put the new token [B, Hkv, 1, D] in place of each (sequence, head)'s lowest-priority slot,
        by the route ``allocate`` chose for this device and policy. ``active`` [B] bool (None: every
        row): a row left out writes nothing and counts no eviction."""
        self.evictor(self, key, value, new_score, token_index, position, value_norm, active)

    def _evict_by_priority(self, key, value, new_score, token_index, position, value_norm, active=None) -> None:
        """The policy's priority computed in torch (the kernels' rules), then the backend's
        ``evict_and_insert``: the reference on the CPU, the kernel on Triton."""
        mass = self.scores.sum(dim=-1)  # before the overwrite (see _count_one_eviction)
        priority = self.priority(self.scores, self.token_index, token_index, self.value_norm)
        dropped, dropped_score = self.kernels.evict_and_insert(
            priority, self.keys, self.values, self.scores, self.token_index, self.positions, key, value, new_score,
            token_index, position, self.value_norm, value_norm, active, coordinates=self.coordinates)
        self._count_one_eviction(dropped, dropped_score, mass)

    def _evict_fused(self, key, value, new_score, token_index, position, value_norm, active=None) -> None:
        """The policy's rank, the priority, argmin and the overwrite from the policy's parameters: one
        launch on Triton, ``reference.evict_by_policy`` on the CPU."""
        mass = self.scores.sum(dim=-1)
        dropped, dropped_score = self.kernels.evict_by_policy(
            self.keys, self.values, self.scores, self.token_index, self.positions, key, value, new_score, token_index,
            position, self.value_norm, value_norm, active, recent=self.rows.recent, sinks=self.rows.sinks,
            coordinates=self.coordinates, **self.fused_eviction_parameters)
        self._count_one_eviction(dropped, dropped_score, mass)

    def _evict_to_tier(self, key, value, new_score, token_index, position, value_norm, active=None) -> None:
        """The victim chosen once (the backend's ``lowest_slots``: the tier's columns never go), handed to
        the tier, then overwritten (the backend's ``write_slots``, the format's other per-slot tensors by
        ``write_extras``): the tier archives exactly the token the slot held. The tier's layers take
        every row every step (``masks_inactive_rows``)."""
        mass = self.scores.sum(dim=-1)
        priority = self.priority(self.scores, self.token_index, token_index, self.value_norm)
        slot = self.kernels.lowest_slots(self.port.policy_part(priority))
        self.tier.archive(self.port, slot)
        stored = self.format.encode(key, value)  # (codes go where the token would; scales beside them)
        self.format.write_extras(slot, self.stored, stored, active, self.coordinates)
        dropped, dropped_score = self.kernels.write_slots(
            slot, self.keys, self.values, self.scores, self.token_index, self.positions, stored["keys"],
            stored["values"], new_score, token_index, position, self.value_norm, value_norm, active,
            coordinates=self.coordinates)
        self._count_one_eviction(dropped, dropped_score, mass)

    def _count_one_eviction(self, dropped, dropped_score, mass) -> None:
        """``_count_evictions`` for one slot in fewer ops: scores are >= 0 and empty and padding slots
        hold score 0 (no attention reaches them), so an empty slot dropped held 0 and a (sequence,
        head) of mass 0 dropped 0: neither needs a mask or a branch. A row an active mask left out
        reports dropped -1 and score 0: its counters add 0."""
        self.evicted += dropped >= 0
        self.evicted_share += dropped_score / mass.clamp_min(1e-30)

    def _count_evictions(self, evicted: torch.Tensor, dropped_score: torch.Tensor, mass: torch.Tensor) -> None:
        """``evicted`` [B, Hkv] (bool, or a count), ``dropped_score`` their summed score, ``mass`` the
        score mass of the (sequence, head) at that moment."""
        self.evicted += evicted
        self.evicted_share += torch.where(mass > 0, dropped_score / mass.clamp_min(1e-30), 0.0) * (evicted > 0)

    # -- a multi-token step over a full cache -----------------------------------------------------------
    def _select(self, key, value, new_scores, token_index, positions, value_norm, newest) -> None:
        """Several new tokens (a prefill chunk, or padding): keep the best C of slots + new
        (``newest`` [B]: each row's newest token index, this step's counted)."""
        batch, heads, q_len, head_dim = key.shape
        used, capacity = self.slots_in_use, self.capacity
        expand = (batch, heads, q_len)
        stored = self.format.encode(key, value)
        candidates = {
            **{name: torch.cat([self.stored[name][:, :, :used], new], dim=2) for name, new in stored.items()},
            "scores": torch.cat([self.scores[:, :, :used], new_scores], dim=2),
            "token_index": torch.cat([self.token_index[:, :, :used], token_index.unsqueeze(1).expand(expand)], dim=2),
            "positions": torch.cat([self.positions[:, :, :used], positions.unsqueeze(1).expand(expand)], dim=2),
        }
        if value_norm is not None:
            candidates["value_norm"] = torch.cat([self.value_norm[:, :, :used], value_norm], dim=2)
        priority = self.priority(candidates["scores"], candidates["token_index"], newest, candidates.get("value_norm"))
        keep = priority.topk(capacity, dim=-1).indices.sort(dim=-1).values
        valid = candidates["token_index"] >= 0
        mass = candidates["scores"].masked_fill(~valid, 0).sum(dim=-1)
        kept_valid = valid.gather(2, keep)
        dropped_score = mass - candidates["scores"].gather(2, keep).masked_fill(~kept_valid, 0).sum(dim=-1)
        if self.tier.archives:  # the candidates that are not kept, for the tier to take
            dropped = valid & ~torch.zeros_like(valid).scatter_(2, keep, True)
            self.tier.archive_dropped(self.port, candidates, dropped)
        targets = self.per_slot_tensors()
        for name, candidate in candidates.items():
            index = keep if candidate.dim() == 3 else keep.unsqueeze(-1).expand(-1, -1, -1, candidate.shape[-1])
            targets[name][:, :, :capacity] = reference.gather_slots(candidate, index)
        self._count_evictions(valid.sum(-1) - kept_valid.sum(-1), dropped_score, mass)
        self.slots_in_use = capacity
