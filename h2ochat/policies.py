"""Eviction policies: how a fixed number of KV slots is split, and which token goes when one must.

A policy is a name, a way to split the budget (heavy / recent / sink slots) and a small pure
function of (scores, token indices) that ranks the evictable tokens: higher = keep. Everything a
policy does not decide is shared: the R most recent tokens are always kept, empty and padding
slots always go first, and exactly the lowest-ranked token among the rest is dropped.
Adding a policy is one function plus one entry in POLICIES.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

RankFn = Callable[[torch.Tensor, torch.Tensor, "SlotBudget", "torch.Generator | None"], torch.Tensor]


@dataclass(frozen=True)
class SlotBudget:
    """How the slots of one (layer, sequence, KV head) are shared out."""

    slots: int  # capacity C; for the full policy the initial allocation (it grows)
    heavy: int  # slots for tokens kept on merit (heavy hitters, sinks' partners)
    recent: int  # the R most recent tokens, never evicted
    sinks: int = 0  # the first N tokens, never evicted (StreamingLLM)
    evicts: bool = True  # False: the full cache, which grows instead

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError(f"the cache needs at least 1 slot, got {self.slots}")
        if self.evicts and self.recent < 1:
            raise ValueError("the recent window needs at least 1 slot (the token being generated)")
        if self.evicts and self.heavy + self.recent + self.sinks != self.slots:
            raise ValueError("heavy + recent + sinks must add up to the slots")


def _rank_by_score(scores, token_index, budget, generator):
    return scores


def _rank_oldest_first(scores, token_index, budget, generator):
    return token_index.to(torch.float32)


def _rank_keep_sinks(scores, token_index, budget, generator):
    rank = token_index.to(torch.float32)
    return rank.masked_fill(token_index < budget.sinks, float("inf"))


def _rank_randomly(scores, token_index, budget, generator):
    # a seeded generator lives on one device (the CPU): draw there, then move
    device = generator.device if generator is not None else scores.device
    return torch.rand(scores.shape, generator=generator, device=device).to(scores.device)


@dataclass(frozen=True)
class Policy:
    name: str
    rank: RankFn
    summary: str

    def split(self, slots: int, heavy_ratio: float = 0.5, sinks: int = 4) -> SlotBudget:
        """Share ``slots`` out as this policy wants them."""
        if self.name == "full":
            return SlotBudget(slots, heavy=0, recent=slots, evicts=False)
        if self.name == "local":
            return SlotBudget(slots, heavy=0, recent=slots)
        if self.name == "sink":
            if not 0 < sinks < slots:
                raise ValueError(f"--sinks must be between 1 and the slots - 1 ({slots - 1}), got {sinks}")
            return SlotBudget(slots, heavy=0, recent=slots - sinks, sinks=sinks)
        if not 0.0 <= heavy_ratio < 1.0:
            raise ValueError(f"--heavy-ratio must be in [0, 1), got {heavy_ratio}")
        heavy = min(int(slots * heavy_ratio), slots - 1)
        return SlotBudget(slots, heavy=heavy, recent=slots - heavy)


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("h2o", _rank_by_score, "heavy hitters (highest accumulated attention) + recent window"),
        Policy("local", _rank_oldest_first, "recent window only (sliding window)"),
        Policy("sink", _rank_keep_sinks, "first N tokens + recent window (StreamingLLM)"),
        Policy("random", _rank_randomly, "random non-recent token evicted (a sanity baseline)"),
        Policy("full", _rank_oldest_first, "no eviction: the cache grows with the text"),
    )
}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None


def keep_priority(
    policy: Policy,
    budget: SlotBudget,
    scores: torch.Tensor,
    token_index: torch.Tensor,
    newest_index: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Priority of every slot [B, Hkv, S] (higher = keep): +inf for the recent window, -inf for
    empty or padding slots, the policy's rank otherwise. ``newest_index`` [B] is the token index
    of each sequence's newest token."""
    priority = policy.rank(scores, token_index, budget, generator)
    recent = token_index > (newest_index - budget.recent).view(-1, 1, 1)
    priority = priority.masked_fill(recent, float("inf"))
    return priority.masked_fill(token_index < 0, float("-inf"))
