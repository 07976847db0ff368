"""The tier contract: what a layer's slots hand to a second home for tokens, and what it may add.

A layer (``kv.layer.H2OLayer``) is its slots, its policy's parameters, its kernels and a tier. The
policy works on the layer's first slot columns; a tier may own ``columns`` more (the recall tier's
recall slots), which the policy never ranks and never evicts. Where those columns are is the tier
port's secret (``kv.tier_port.TierPort``, made by the layer at allocation): a tier is handed the port
and reads and writes its own columns through it (named views), never the layer. The layer calls the
tier at fixed points of a step, always with its port and, where the step matters, its context
(``kv.numbering.StepContext``: the numbers, the compiled/static mode, the rotary):

- ``allocate(port, batch, heads, head_dim, value_dim, dtype, device)``: the layer's slots exist;
- ``reserve(port, q_len, context)``: before the step (from ``H2OCache.position_ids``, host counters
  only), room for whatever these tokens can evict;
- ``before_attention(port, query, new_valid, scale, context)``: e.g. bring recalled pages into its
  columns; returns one more attention column per query row for what the tier holds outside the slots
  (``reference.attend_with_scores``' ``rest``; ``scale``: the attention's), or None;
- ``before_insert(port)``: after the attention, before this step's scores rank anything;
- ``archive(port, slot)``: a decode step evicts ``slot`` [B, Hkv] of each (sequence, KV head);
  called before the slot is overwritten (``port.victims(slot)`` reads what it holds), with exactly
  the victim the eviction then writes over;
- ``archive_dropped(port, candidates, dropped)``: a multi-token step dropped these candidates
  (named tensors [B, Hkv, N, ...], the slot format's among them);
- ``renumber(port, renumbering, rotary)``: the layer's tokens moved to new positions.

A row moves between caches (a server parks a finished conversation in host memory and imports it
into a row again when it comes back: ``H2OCache.export_row`` / ``import_row``) with its tier:
``export_row(row, device, copy=True)`` copies the row's ``state_tensors()`` (the same names), where a
store that grows with the text keeps only the slots this row's tokens reach (not the capacity the whole
batch allocated), so a parked row costs what it holds (``copy=False``: views of them, for a cache about
to be dropped); ``import_row(row, state)`` makes room for them and
overwrites the whole row, the slots past them emptied (nothing of the row's last conversation stays).
A tier that recalls may say how many pages it brought back into one row (``pages_recalled(row)``,
optional: ``pages_recalled`` below reads 0 without it).

A tier reports its own device bytes, host bytes and statistics (``record``, ``stats``); nothing
outside the cache package asks which kind of tier a cache has. ``NO_TIER`` is the tier of a plain
H2O cache: no columns, nothing archived, every hook a no-op (``NoTier``). A new tier is one module
with a class of these methods and a spec (``TierSpec``) that makes one per layer
(``H2OCache(tier=spec)``, ``H2OCache.use_tier``), plus its option: tests/disk_tier.py sketches a
second tier under a host store that plugs in so (tests/test_tier_port.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .numbering import Renumbering, StepContext
from .tier_port import TierPort


class Tier(Protocol):
    columns: int  # slot columns the tier owns after the policy's
    archives: bool  # whether evicted tokens must be seen before they are overwritten

    def allocate(self, port: TierPort, batch: int, heads: int, head_dim: int, value_dim: int, dtype,
                 device) -> None: ...
    def state_tensors(self) -> dict[str, torch.Tensor]: ...
    def empty_value(self, name: str) -> int: ...
    def reset(self) -> None: ...
    def reserve(self, port: TierPort, q_len: int, context: StepContext) -> None: ...
    def before_attention(self, port: TierPort, query: torch.Tensor, new_valid: torch.Tensor | None, scale: float,
                         context: StepContext) -> tuple[torch.Tensor, torch.Tensor] | None: ...
    def before_insert(self, port: TierPort) -> None: ...
    def archive(self, port: TierPort, slot: torch.Tensor) -> None: ...
    def archive_dropped(self, port: TierPort, candidates: dict[str, torch.Tensor], dropped: torch.Tensor) -> None: ...
    def renumber(self, port: TierPort, renumbering: Renumbering, rotary) -> None: ...
    def export_row(self, row: int, device, copy: bool = True) -> dict[str, torch.Tensor]: ...
    # ``moved_from``: the row ``state`` was exported from in this cache, when it is a move of a running row
    # (``H2OCache.move_row``: it goes on as it would have there), not a conversation resumed
    def import_row(self, row: int, state: dict[str, torch.Tensor], moved_from: int | None = None) -> None: ...


class NoTier:
    """The tier of a plain cache: evicted tokens are gone for good (stateless: one serves every layer)."""

    columns = 0
    archives = False

    def allocate(self, port, batch, heads, head_dim, value_dim, dtype, device) -> None:
        pass

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def empty_value(self, name: str) -> int:
        return 0

    def reset(self) -> None:
        pass

    def reserve(self, port, q_len: int, context) -> None:
        pass

    def before_attention(self, port, query, new_valid, scale, context) -> None:
        return None

    def before_insert(self, port) -> None:
        pass

    def archive(self, port, slot) -> None:
        pass

    def archive_dropped(self, port, candidates, dropped) -> None:
        pass

    def renumber(self, port, renumbering, rotary) -> None:
        pass

    def export_row(self, row: int, device, copy: bool = True) -> dict[str, torch.Tensor]:
        return {}

    def import_row(self, row: int, state: dict[str, torch.Tensor], moved_from: int | None = None) -> None:
        pass


NO_TIER_LAYER = NoTier()


def pages_recalled(cache, row: int) -> int:
    """Pages the tiers of ``cache`` brought back into row ``row``'s slots in its conversation so far
    (a parked row takes its count along; summed over layers and KV heads; 0 for tiers that recall nothing)."""
    return sum(layer.tier.pages_recalled(row) for layer in cache.layers
               if layer.is_initialized and hasattr(layer.tier, "pages_recalled"))


class TierSpec(Protocol):
    """What a cache is told about its tier: it makes one ``Tier`` per layer and speaks for them all."""

    columns: int
    masks_inactive_rows: bool  # whether a decode step may leave rows out (``H2OCache.position_ids``)
    # whether a cache over the first rows (``H2OCache.prefix``) may step with the same tiers: its layers
    # share them, and a tier takes a step of the first k rows (a port of k rows) as one of every row
    # with the others left out
    row_prefixes: bool

    def make(self) -> Tier: ...
    def check(self, cache) -> None: ...
    def compile_blocker(self, cache) -> str | None: ...
    def record(self, cache) -> dict | None: ...
    def stats(self, cache): ...


class NoTierSpec:
    columns = 0
    masks_inactive_rows = True
    row_prefixes = True

    def make(self) -> NoTier:
        return NO_TIER_LAYER

    def check(self, cache) -> None:
        pass

    def compile_blocker(self, cache) -> str | None:
        return None

    def record(self, cache) -> dict | None:
        return None

    def stats(self, cache) -> None:
        return None


NO_TIER = NoTierSpec()
