"""The exact selector where the cold store is in the same memory as the step (a CPU): pages scored from
the cold store's own keys, where they lie, instead of from a copy of every evicted key beside them.

``KeyCodes(bits=None)`` (the exact digest) keeps each evicted key a second time, at the model's dtype: on
SmolLM2 in bf16 another 11,520 bytes per evicted token over the cold store's 21,960. The cold store holds
the same keys in the same slot layout (slot n of a row and head: its n-th evicted token; the digest and
the store take every append together, ``RecallTier.to_cold``), so ``ColdKeys`` is that digest with the
store's ``keys`` and ``count`` as its own: appending, reserving and growing are the store's, and the
scores are the copy's, to the bit.

One difference, after a re-numbering of RoPE positions: the store keeps a key rotated to the position it
was encoded at and turns it when a page is brought back, while the digest scores keys at their current
positions. ``rebuild`` therefore writes the keys at their new positions into the store (and marks them
encoded there), so what is scored is what a recalled page attends. A store of int8 keys (``--cold-dtype
int8``) or one on another device than the step keeps the copy (``RecallTier.allocate``).
"""

from __future__ import annotations

import torch

from .digests import KeyCodes


class ColdKeys(KeyCodes):
    """``KeyCodes(bits=None)`` reading and writing nothing of its own: its keys and count are ``cold``'s."""

    def __init__(self, cold, *, backend=None):
        self.cold, self.page, self.frames, self.backend = cold, cold.page, cold.frames, backend
        self.bits, self.rotation, self.scale, self.offset = None, None, None, None

    @staticmethod
    def fits(cold, device) -> bool:
        """Whether ``cold``'s keys can be scored where they are: float keys in the step's memory."""
        return not cold.quantized_keys and cold.keys.device == torch.device(device)

    def _turned(self, keys_or_queries: torch.Tensor) -> torch.Tensor:
        """The queries as the store's keys are scored with (``ColdStore.scored_queries``; no rotation here)."""
        return self.cold.scored_queries(keys_or_queries)

    @property
    def codes(self) -> torch.Tensor:
        return self.cold.keys

    @property
    def count(self) -> torch.Tensor:
        return self.cold.count

    def first_rows(self, rows: int) -> "ColdKeys":
        return ColdKeys(self.cold.first_rows(rows), backend=self.backend)

    # -- the store does these ----------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def reserve(self, needed: int) -> None:
        """(The cold store reserves its own room, in the same step.)"""

    def append(self, keys: torch.Tensor, token_index: torch.Tensor, *, reserve: bool = True) -> None:
        """(The cold store took these keys, just before: ``RecallTier.to_cold``.)"""

    def rebuild(self, keys_by_slot: torch.Tensor) -> None:
        """After a re-numbering: the held keys at their new positions into the store, encoded there (the
        rows that did not move are the caller's to keep: ``RecallTier.renumber`` keeps the store's)."""
        self.cold.encode_where_they_are(keys_by_slot, self.valid)

    def nbytes(self) -> int:
        return 0
