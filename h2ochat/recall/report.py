"""The cold tier in a few figures for people: the REPL's /cache block and the status line's recall part.

A reading of the cache's public state (``H2OCache.tier_stats()``, the recall slots' token indices),
nothing changes. Counts are per (layer, sequence, KV head), averaged, like the rest of /cache. "This
turn" figures are differences from a ``TurnStart`` taken before the turn: the tier's counters only
grow while one cache lives, so a difference is what the turn did. Reads the device: compute it once
per step (ui.StatusLine), not once per render.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .spec import RecallSpec
from .tiered import TierStats


def has_cold_tier(cache) -> bool:
    return isinstance(cache.tier, RecallSpec)


@dataclass(frozen=True)
class TurnStart:
    """The tier's counters when a turn began, and the cache they are of."""

    cache: weakref.ref  # weak: a snapshot must not keep a replaced cache's tensors alive
    stats: TierStats

    @classmethod
    def of(cls, cache) -> "TurnStart | None":
        return cls(weakref.ref(cache), cache.tier_stats()) if has_cold_tier(cache) else None


@dataclass(frozen=True)
class TierSummary:
    recall_slots: int  # per (layer, sequence, KV head), part of the device budget
    page: int
    selector: str
    cold_limit: int | None  # tokens per (layer, sequence, KV head); None: no limit
    rows: int  # (layer, sequence, KV head) triples the means below are over
    cold_pages: float  # held in the cold store, mean per (layer, sequence, KV head)
    cold_tokens: float
    dropped_tokens: float  # lost to --cold-limit
    host_bytes: int  # every cold store (allocated host memory)
    digest_bytes: int  # every page digest (device memory): what scores the pages
    staged_tokens: float  # on the staging page (attended; the cold store takes them at the next flush)
    device_bytes: int  # every device byte of the tier beyond its recall columns (selector + staging + frames)
    pages_per_summary: int  # > 1: the summary cap was reached and each summary covers that many pages
    summary_cap: int | None  # summaries per (layer, sequence, KV head) on the device; None: one stage, no cap
    pages_copied: float  # into recall slots since the cache was built, mean per (layer, sequence, KV head)
    pages_copied_turn: float  # of which during this turn
    recalled_share: float | None  # attention that went to recalled tokens since the cache was built
    recalled_share_turn: float | None  # ... during this turn (None: nothing attended in it)
    this_turn: bool  # the turn figures are the turn's (False: no turn on this cache yet; they are since
    # the cache was built, e.g. the re-read after /budget)


def _share(recalled: float, attended: float) -> float | None:
    return recalled / attended if attended > 0 else None


def summarize_tier(cache, since: TurnStart | None = None) -> TierSummary | None:
    """The cold tier's figures (None for a cache without one). Turn figures: since ``since``, the
    turn's start; when the cache is not the one ``since`` was taken of, the turn built it (a
    conversation's first turn, a re-read) and they count from zero. ``since`` None: no turn on this
    cache (whoever replaces the cache outside a turn drops its ``TurnStart``)."""
    if not has_cold_tier(cache):
        return None
    stats = cache.tier_stats()
    layers = [layer for layer in cache.layers if layer.is_initialized]
    rows = sum(layer.tier.cold.count.numel() for layer in layers)
    this_turn = since is not None
    start = since.stats if this_turn and since.cache() is cache else None
    copied_before = start.pages_copied if start else 0
    recalled_before, attended_before = (start.recalled_mass, start.attended_mass) if start else (0.0, 0.0)

    def mean(total: float) -> float:
        return total / rows if rows else 0.0

    config = cache.tier.config
    return TierSummary(
        recall_slots=config.slots, page=config.page, selector=cache.tier.selector(cache), cold_limit=config.cold_limit,
        rows=rows, cold_pages=mean(stats.cold_pages), cold_tokens=mean(stats.cold_tokens),
        dropped_tokens=mean(stats.dropped_tokens),
        host_bytes=stats.host_bytes, digest_bytes=stats.digest_device_bytes, staged_tokens=mean(stats.staged_tokens),
        device_bytes=stats.device_bytes, pages_per_summary=stats.pages_per_summary, summary_cap=stats.summary_cap,
        pages_copied=mean(stats.pages_copied), pages_copied_turn=mean(stats.pages_copied - copied_before),
        recalled_share=_share(stats.recalled_mass, stats.attended_mass),
        recalled_share_turn=_share(stats.recalled_mass - recalled_before, stats.attended_mass - attended_before),
        this_turn=this_turn,
    )


def recall_slot_counts(cache, sequence: int = 0) -> torch.Tensor:
    """[tokens seen] for each token index of ``sequence``: how many (layer, KV head) recall slots hold
    it now (all 0 for a cache without a cold tier)."""
    seen = int(cache.tokens_fed[sequence]) if cache.tokens_fed is not None else 0
    counts = torch.zeros(seen, dtype=torch.long)
    if has_cold_tier(cache):
        for layer in cache.layers:
            if layer.is_initialized:
                tokens = layer.tier.recalled_token_index()[sequence].flatten().cpu()
                counts += torch.bincount(tokens[tokens >= 0], minlength=seen)[:seen]
    return counts


def recalled_token_indices(cache, sequence: int = 0) -> torch.Tensor:
    """Token indices of ``sequence`` in a recall slot of some layer and KV head now (sorted, unique;
    empty for a cache without a cold tier)."""
    return recall_slot_counts(cache, sequence).nonzero().flatten()
