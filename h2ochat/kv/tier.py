"""The tier contract: what a layer's slots hand to a second home for tokens, and what it may add.

A layer (``kv.layer.H2OLayer``) is its slots, its policy's parameters, its kernels and a tier. The
policy works on the first ``capacity`` slot columns; a tier may own ``columns`` more after them (the
recall tier's recall slots), which the policy never ranks and never evicts. The layer calls the tier
at fixed points of a step, always with the layer itself (the tier reads the slots, never writes the
layer's own fields):

- ``reserve(layer, q_len, context)``: before the step (from ``H2OCache.position_ids``, host counters
  only), room for whatever these tokens can evict;
- ``before_attention(layer, query, new_valid, context)``: e.g. bring recalled pages into its columns;

``context`` is the step's ``kv.numbering.StepContext`` (its numbers, the compiled/static mode, the
rotary): a tier reads the step's mode there, never through the layer's cache.
- ``before_insert(layer)``: after the attention, before this step's scores rank anything;
- ``archive(layer, slot)``: a decode step evicts ``slot`` [B, Hkv] of each (sequence, KV head); called
  before the slot is overwritten, with exactly the victim the eviction then writes over;
- ``archive_dropped(layer, candidates, dropped)``: a multi-token step dropped these candidates;
- ``renumber(layer, renumbering, rotary)``: the layer's tokens moved to new positions.

A row moves between caches (a server parks a finished conversation in host memory and imports it
into a row again when it comes back: ``H2OCache.export_row`` / ``import_row``) with its tier:
``export_row(row, device)`` copies the row's ``state_tensors()`` (the same names), where a store that
grows with the text keeps only the slots this row's tokens reach (not the capacity the whole batch
allocated), so a parked row costs what it holds; ``import_row(row, state)`` makes room for them and
overwrites the whole row, the slots past them emptied (nothing of the row's last conversation stays).
A tier that recalls may say how many pages it brought back into one row (``pages_recalled(row)``,
optional: ``pages_recalled`` below reads 0 without it).

A tier reports its own device bytes, host bytes and statistics (``record``, ``stats``); nothing
outside the cache package asks which kind of tier a cache has. ``NO_TIER`` is the tier of a plain
H2O cache: no columns, nothing archived, every hook a no-op (``NoTier``, beside the layer that
defaults to it: a decoded token's route does not leave the layer for it). A new tier is one class
with these methods and a spec (``TierSpec``) that makes one per layer (``H2OCache(tier=spec)``,
``H2OCache.use_tier``).


NOT YET BUILT (issue 33, items 2, 4 and 8; designed here, the hooks above are still today's):

- The tier port (item 2). A ``TierPort`` made by the layer at allocation holds the layout secret
  alone ("policy columns first, the tier's ``columns`` after ``capacity``, the last page stages"):
  it hands a tier its own columns as named views (``port.columns()``: keys, values, scales, token
  index, positions, scores of columns [capacity, capacity + tier.columns)), the victims of an
  eviction (``port.victims(slot)``: the named values at the slot, read before the overwrite) and
  writes into its columns only (``port.write(name, ...)``). Hooks then take ``(port, ..., context)``
  instead of the layer; ``recall.tier``, ``split.py`` and ``kv.accounting`` ask the port for the
  column ranges instead of slicing at ``layer.capacity``. ``NoTier`` moves here (the layer imports no
  tier), and a disk tier under recall's host store is one module with a ``TierSpec`` plus its option.
- One host-counter object (item 4): ``HostCounters`` becomes mutable and held by reference, made by
  the cache and shared by its prefixes (``H2OCache.prefix``), so ``take_host_counters`` and the copies
  around each bucket step go away; its docstring lists its writers (the layer's step, ``import_row``,
  ``restore_host_counters``, the server backend's ``set_host_counters``).
- Structural rules (item 8): tests that the layer imports no tier module, that tier modules touch a
  layer only through the port, that no module reads another's ``_private`` names, and a field-write
  test that sees ``setattr``, writes into tensors reached through another object's attribute
  (``x.t.copy_``, ``x.t[...] =``) and container mutation, in place of the token-route ceiling.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .layer import NO_TIER_LAYER, NoTier
from .numbering import StepContext


class Tier(Protocol):
    columns: int  # slot columns the tier owns after the policy's
    archives: bool  # whether evicted tokens must be seen before they are overwritten

    def allocate(self, layer, batch: int, heads: int, head_dim: int, value_dim: int, dtype, device) -> None: ...
    def state_tensors(self) -> dict[str, torch.Tensor]: ...
    def empty_value(self, name: str) -> int: ...
    def reset(self) -> None: ...
    def reserve(self, layer, q_len: int, context: StepContext) -> None: ...
    def before_attention(self, layer, query: torch.Tensor, new_valid: torch.Tensor | None,
                         context: StepContext) -> None: ...
    def before_insert(self, layer) -> None: ...
    def archive(self, layer, slot: torch.Tensor) -> None: ...
    def archive_dropped(self, layer, candidates: dict[str, torch.Tensor], dropped: torch.Tensor) -> None: ...
    def renumber(self, layer, renumbering, rotary) -> None: ...
    def export_row(self, row: int, device) -> dict[str, torch.Tensor]: ...
    def import_row(self, row: int, state: dict[str, torch.Tensor]) -> None: ...


def pages_recalled(cache, row: int) -> int:
    """Pages the tiers of ``cache`` brought back into row ``row``'s slots in its conversation so far
    (a parked row takes its count along; summed over layers and KV heads; 0 for tiers that recall nothing)."""
    return sum(layer.tier.pages_recalled(row) for layer in cache.layers
               if layer.is_initialized and hasattr(layer.tier, "pages_recalled"))


class TierSpec(Protocol):
    """What a cache is told about its tier: it makes one ``Tier`` per layer and speaks for them all."""

    columns: int
    masks_inactive_rows: bool  # whether a decode step may leave rows out (``H2OCache.position_ids``)

    def make(self) -> Tier: ...
    def check(self, cache) -> None: ...
    def compile_blocker(self, cache) -> str | None: ...
    def record(self, cache) -> dict | None: ...
    def stats(self, cache): ...


class NoTierSpec:
    columns = 0
    masks_inactive_rows = True

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
