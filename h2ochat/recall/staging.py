"""The staging page: a decode step's evicted token waits in the layer's last P slot columns.

A decode step evicts at most one token per (sequence, KV head). Appending it to the cold store and
the digest on every step (an index plan, a scatter per buffer, a quantisation) cost more ops than
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

import torch

from .step import RecallSlots


class StagingPage:
    """P staging columns of one layer (views of its slots) and the count of entries per (sequence, head)."""

    def __init__(self, slots: RecallSlots, device):
        self.slots = slots
        self.page = slots.token_index.shape[-1]
        batch, heads = slots.token_index.shape[:2]
        self.count = torch.zeros(batch, heads, dtype=torch.long, device=device)  # entries written since the flush
        self.steps = 0  # host: decode steps since the flush (an upper bound of ``count``)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"count": self.count}

    def put(self, coordinates, key, value, token_index, position) -> None:
        """One entry per (sequence, head) [B, H, ...] into the next staging column (fixed shapes, no
        host read: a compiled step holds it)."""
        where = (*coordinates, self.count)
        self.slots.keys.index_put_(where, key)
        self.slots.values.index_put_(where, value)
        self.slots.token_index.index_put_(where, token_index)
        self.slots.positions.index_put_(where, position)
        self.count += 1

    def full(self) -> bool:
        """Whether the next decode step could write past the page (host counter)."""
        return self.steps >= self.page

    def held(self) -> torch.Tensor:
        """[B, H]: real tokens staged now."""
        return (self.slots.token_index >= 0).sum(dim=-1)

    def clear(self) -> None:
        """After a flush: the columns hold nothing (token index -1: not attended)."""
        self.slots.token_index.fill_(-1)
        self.slots.positions.fill_(-1)
        self.count.zero_()
        self.steps = 0

    def nbytes(self) -> int:
        """Device bytes beyond the slots it lives in: the count."""
        return self.count.numel() * self.count.element_size()
