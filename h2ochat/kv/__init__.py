"""The KV cache, composed: a transformers ``Cache`` adapter (``cache``) over layers (``layer``), each
made of slots in a format (``slot_format``), its rows' policy parameters (``rows``), a kernel backend,
its eviction (``eviction``) and a tier (``tier``: none, or ``h2ochat.recall``'s) reached through a
port (``tier_port``); step numbering and re-numbering (``numbering``, ``positions``); the host
counters, one object a cache shares with its views (``host_counters``); one factory from the
command's settings stands above kv and recall (``h2ochat.cache_factory``)."""

from .cache import H2OCache
from .accounting import LayerStats
from .last_update import last_update
from .layer import AttentionMismatchError, H2OLayer
from .host_counters import HostCounters, SavedHostCounters
from .numbering import PositionLimitError, Renumbering, StepNumbers
from .rows import CacheShapeError, RowParameters, RowPolicies, RowSpec, RowState
from .tier import NO_TIER, NoTier, Tier, TierSpec

__all__ = [
    "H2OCache", "H2OLayer", "LayerStats", "AttentionMismatchError", "last_update", "HostCounters",
    "SavedHostCounters",
    "PositionLimitError", "Renumbering", "StepNumbers", "CacheShapeError", "RowParameters", "RowPolicies",
    "RowSpec", "RowState", "NO_TIER", "NoTier", "Tier", "TierSpec",
]
