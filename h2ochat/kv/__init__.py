"""The KV cache, composed: a transformers ``Cache`` adapter (``cache``) over layers (``layer``), each
made of slots, its rows' policy parameters (``rows``), a kernel backend and a tier (``tier``: none,
or ``h2ochat.recall``'s); step numbering and re-numbering (``numbering``). The factory that pairs a
cache with its tier stands above kv and recall (``h2ochat.cache_factory``)."""

from .cache import H2OCache
from .accounting import LayerStats
from .layer import AttentionMismatchError, H2OLayer, last_update
from .numbering import HostCounters, PositionLimitError, Renumbering, StepNumbers
from .rows import CacheShapeError, RowParameters, RowPolicies, RowSpec, RowState
from .tier import NO_TIER, NoTier, Tier, TierSpec

__all__ = [
    "H2OCache", "H2OLayer", "LayerStats", "AttentionMismatchError", "last_update", "HostCounters",
    "PositionLimitError", "Renumbering", "StepNumbers", "CacheShapeError", "RowParameters", "RowPolicies",
    "RowSpec", "RowState", "NO_TIER", "NoTier", "Tier", "TierSpec",
]
