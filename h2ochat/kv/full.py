"""The two kinds of cache, by what happens when a step brings more tokens than there are slot
columns: a bounded cache (every policy but ``full``) keeps its columns and the policy evicts; the
full cache (``--policy full``, the reference every bounded policy is measured against) never evicts
and its columns grow with the text, doubling so a reallocation is rare.

The kind is chosen once per cache from its rows' policies (``cache_kind``); a layer of a cache that
grows asks its kind for room before each step (``columns_needed``), every layer asks for its length
limit (``max_length``).
What the full cache does differently from a bounded one is written here and nowhere else in ``kv``;
commands read ``H2OCache.grows`` / ``evicts``, which answer from the kind.
"""

from __future__ import annotations

import torch


class BoundedCache:
    """A fixed number of slot columns per layer: the policy evicts when they are full."""

    name = "bounded"
    grows = False
    compile_blocker = None

    def max_length(self, capacity: int) -> int:
        return capacity

    def position_limit(self, max_positions: int) -> str | None:
        """Why re-numbering cannot make room at the model's position limit (None: it can)."""
        return None


class FullCache:
    """Every token kept: the columns grow (at least double) when a step would overflow them."""

    name = "full"
    grows = True
    compile_blocker = "the full cache grows its slots (shapes change)"

    def columns_needed(self, in_use: int, capacity: int, q_len: int) -> int | None:
        """The columns to grow to before a step of ``q_len`` tokens, or None when they fit."""
        return max(in_use + q_len, 2 * capacity) if in_use + q_len > capacity else None

    def max_length(self, capacity: int) -> int:
        return -1  # transformers' "no limit"

    def position_limit(self, max_positions: int) -> str | None:
        return (f"the full cache reached the model's {max_positions}-position limit; "
                "pick a policy that evicts to keep going")


BOUNDED, FULL = BoundedCache(), FullCache()


def cache_kind(policies) -> BoundedCache | FullCache:
    """The full cache when a row's policy keeps every token, else a bounded one. (In a mixed batch
    (``eval``) a full row gets its slots up front, as many as the text has tokens, so it never grows.)"""
    return FULL if any(policy.grows for policy in policies) else BOUNDED


def widened(tensor: torch.Tensor, capacity: int, fill: int) -> torch.Tensor:
    """``tensor`` [B, H, C, ...] with its slot dimension padded to ``capacity`` with ``fill``."""
    pad = tensor.new_full((*tensor.shape[:2], capacity - tensor.shape[2], *tensor.shape[3:]), fill)
    return torch.cat([tensor, pad], dim=2)
