"""Batch rows: what each row of a cache follows (``RowSpec``: its policy, slots and seed), the per-row
policy parameters a layer works with (``RowParameters``, from ``RowPolicies``), and one row's whole
state as moved between caches (``RowState``: what a server parks, or a prefill cache hands over)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..policies import Policy, SlotBudget, get_policy


@dataclass(frozen=True)
class RowSpec:
    """One row of a mixed batch: its policy, its slots per layer and its random seed."""

    policy: Policy
    slots: int
    seed: int | None = None


class CacheShapeError(RuntimeError):
    """A row state that does not fit the cache it is imported into (a programming error)."""


@dataclass
class RowState:
    """One batch row's whole cache state (every layer), normally on the host: what a server parks
    between requests, or moves from a 1-row prefill cache into a row of a batch cache.

    ``layers[i]`` holds layer i's ``H2OLayer.state_tensors()`` for this row: keys/values [Hkv, C, D];
    scores, token_index, positions, value_norm (if the policy uses it) [Hkv, C]; evicted,
    evicted_share [Hkv]. ``counters``: the row's ``tokens_fed`` and ``next_position`` (0-d), shared
    by all layers."""

    layers: list[dict[str, torch.Tensor]]
    counters: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        tensors = [*(t for layer in self.layers for t in layer.values()), *self.counters.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def tokens_fed(self) -> int:
        """Real tokens this row has been fed."""
        return int(self.counters["tokens_fed"])


@dataclass
class RowParameters:
    """A layer's per-row policy parameters: ints/floats when every row shares them, else [B] tensors."""

    recent: int | torch.Tensor
    sinks: int | torch.Tensor
    decay: float | torch.Tensor
    slots: torch.Tensor | None  # each row's own slots, when some row has fewer than the layer holds
    smallest_slots: int
    spare_slots: bool = field(init=False)  # some row has fewer slots than the layer holds (read every step)

    def __post_init__(self):
        self.spare_slots = self.slots is not None


class RowPolicies:
    """Which policy each batch row follows, and what follows from that for every layer: the rows'
    slot budgets per layer, their parameters on a device, their ranks (rows sharing a policy are
    ranked together; a policy with its own draws ranks each row with its own seeded generator,
    over its own slots, only once it holds its budget: as a cache of its own would)."""

    def __init__(self, specs: Sequence[RowSpec], num_layers: int):
        self.specs = list(specs)
        self.policy = get_policy(self.specs[0].policy)
        self.generators = [torch.Generator().manual_seed(r.seed) if r.seed is not None else None for r in self.specs]
        self.uses_value_norm = any(r.policy.uses_value_norm for r in self.specs)
        self.layer_budgets = [r.policy.layer_budgets(r.slots, num_layers) for r in self.specs]
        # the one-launch eviction's parameters, when every row ranks by the same built-in formula
        # (looked up once, not per layer and step)
        same_rank = len({repr(r.policy.fused_eviction) for r in self.specs}) == 1
        self.fused_eviction_parameters = self.policy.fused_eviction if same_rank else None

    @property
    def mixed(self) -> bool:
        return len(self.specs) > 1

    def budgets(self, layer_idx: int) -> list[SlotBudget]:
        return [budgets[layer_idx] for budgets in self.layer_budgets]

    def parameters(self, layer_idx: int, batch: int, device) -> RowParameters:
        budgets = self.budgets(layer_idx)
        if not self.mixed:
            budget = budgets[0]
            return RowParameters(budget.recent, budget.sinks, self.policy.decay, None, budget.slots)
        if len(budgets) != batch:
            raise ValueError(f"the cache has {len(budgets)} row policies but the batch has {batch} rows")

        def per_row(values, dtype):
            if len(set(values)) == 1:
                return values[0]
            return torch.tensor(values, dtype=dtype, device=device)

        slots = [b.slots for b in budgets]
        return RowParameters(
            recent=per_row([b.recent for b in budgets], torch.long),
            sinks=per_row([b.sinks for b in budgets], torch.long),
            decay=per_row([r.policy.decay for r in self.specs], torch.float32),
            slots=torch.tensor(slots, device=device) if min(slots) < max(slots) else None,
            smallest_slots=min(slots),
        )

    def rank(self, scores, token_index, newest, value_norm, rows: RowParameters) -> torch.Tensor:
        """Each row's merit by its own policy (rows sharing a policy are ranked together)."""
        if not self.mixed:
            return self.policy.rank(scores, token_index, newest, value_norm, self.generators[0])
        rank = torch.zeros_like(scores)
        groups: dict[Policy, list[int]] = {}
        for index, spec in enumerate(self.specs):
            groups.setdefault(spec.policy, []).append(index)
        for policy, indices in groups.items():
            if policy.fused_eviction is None:  # e.g. random: each row draws as a cache of its own would
                for index in indices:
                    rank[index:index + 1] = self._own_rank(index, scores, token_index, newest, value_norm, rows)
                continue
            idx = torch.tensor(indices, device=scores.device)
            norm = value_norm[idx] if value_norm is not None else None
            rank[idx] = policy.rank(scores[idx], token_index[idx], newest[idx], norm)
        return rank

    def _own_rank(self, index, scores, token_index, newest, value_norm, rows) -> torch.Tensor:
        """Row ``index`` ranked with its own generator, over its own slots only, and only once it
        holds its budget (draws happen when a cache of its own size would evict)."""
        slots = self.specs[index].slots if rows.slots is not None else scores.shape[-1]
        own = slice(index, index + 1)
        rank = torch.zeros_like(scores[own])
        if not bool(((token_index[own] >= 0).sum(-1) >= slots).all()):
            return rank
        part = (own, slice(None), slice(0, slots))
        norm = value_norm[part].cpu() if value_norm is not None else None
        drawn = self.specs[index].policy.rank(scores[part].cpu(), token_index[part].cpu(), newest[own].cpu(),
                                              norm, self.generators[index])
        rank[:, :, :slots] = drawn.to(scores.device)
        return rank
