"""How a cache's device slots are shared out, how many of each hold a token, and the bytes: the one
description every view prints (the chat's banner, status line, /cache, the /set, /budget and /policy
confirmations, story's summary, the --json records).

The parts, per (layer, sequence, KV head):
- sinks: the first tokens of the text, never evicted;
- heavy: tokens kept on merit (the policy's rank);
- recent: the recent window, never evicted;
- recall (--recall): tokens brought back from the cold tier; part of the device budget.

Counted here from the cache's public state (each layer's ``budget``, its ``token_index`` split into
the policy's and the tier's columns by its ``port``, ``protected()``), not from ``LayerStats``,
whose ``recent`` counts the sinks too and whose ``heavy`` counts the recall slots as kept on merit.
Counts are averaged over (layer, sequence, KV head), like the rest of /cache.

Memory has three figures that must not be read against each other the wrong way: the bytes reserved
(the slots allocated, whatever they hold: early in a chat far more than the text needs), the bytes in
use (the slots holding a token) and what a full cache would hold for the tokens seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..kv import H2OCache


PART_NAMES = ("sinks", "heavy", "recent", "recall")


def amount(value: float) -> str:
    """A mean count: whole numbers as such, others with one decimal."""
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def format_bytes(count: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} B"


@dataclass(frozen=True)
class Parts:
    """One figure per part of the split."""

    sinks: float = 0.0
    heavy: float = 0.0
    recent: float = 0.0
    recall: float = 0.0

    @property
    def total(self) -> float:
        return self.sinks + self.heavy + self.recent + self.recall

    def items(self) -> list[tuple[str, float]]:
        return [(name, getattr(self, name)) for name in PART_NAMES]

    @classmethod
    def mean(cls, parts: list["Parts"]) -> "Parts":
        count = max(len(parts), 1)
        return cls(*(sum(getattr(p, name) for p in parts) / count for name in PART_NAMES))


@dataclass(frozen=True)
class Split:
    """The slots of a (layer, sequence, KV head), and of them the ones holding a token."""

    slots: Parts  # capacity
    held: Parts | None  # in use now (None: not read from the device)
    grows: bool = False  # the full policy: nothing is evicted, the slots grow with the text
    rows: int = 0  # (sequence, KV head) pairs ``held`` is averaged over (one layer's; 0: not allocated)


def _capacity(cache, layer) -> Parts:
    """A layer's slots, from its budget (no device read)."""
    recall = cache.tier.columns  # the tier's own slot columns (0 without one)
    if cache.grows:  # the full cache: what is allocated now (it grows), no split
        return Parts(recent=layer.capacity)
    budget = layer.budget
    return Parts(sinks=budget.sinks, heavy=budget.heavy, recent=budget.recent, recall=recall)


def _held_counts(cache, layer) -> torch.Tensor:
    """[4] slots holding a token, summed over sequences and KV heads: sinks, heavy, recent, recall
    (the layer's port says which columns are the policy's and which the tier's)."""
    index = layer.token_index
    hot = layer.port.policy_part(index)
    valid = hot >= 0
    recall = (layer.port.tier_part(index) >= 0).sum()
    if cache.grows:
        zero = valid.new_zeros(()).sum()
        return torch.stack([zero, zero, valid.sum(), recall])
    sink = valid & (hot < layer.budget.sinks)
    protected = layer.port.policy_part(layer.protected(cache.tokens_fed - 1))
    return torch.stack([sink.sum(), (valid & ~protected).sum(), (valid & protected & ~sink).sum(), recall])


def planned_split(cache) -> Split:
    """The split as the budget lays it out, averaged over layers; reads nothing from the device
    (a banner before the first token, a confirmation)."""
    return Split(Parts.mean([_capacity(cache, layer) for layer in cache.layers]), None, cache.grows)


def layer_splits(cache) -> list[Split]:
    """Each layer's split with the slots in use (one read from the device for all layers)."""
    live = [layer for layer in cache.layers if layer.is_initialized]
    counts = torch.stack([_held_counts(cache, layer) for layer in live]).tolist() if live else []
    by_layer = dict(zip(map(id, live), counts))
    splits = []
    for layer in cache.layers:
        rows = layer.token_index.shape[0] * layer.token_index.shape[1] if layer.is_initialized else 0
        held = Parts(*(c / rows for c in by_layer[id(layer)])) if rows else Parts()
        splits.append(Split(_capacity(cache, layer), held, cache.grows, rows))
    return splits


def cache_split(cache, layers: list[Split] | None = None) -> Split:
    """The cache's split with the slots in use, averaged over layers (``layers``: ``layer_splits``
    when already read)."""
    layers = layer_splits(cache) if layers is None else layers
    return Split(Parts.mean([s.slots for s in layers]), Parts.mean([s.held for s in layers]), cache.grows)


def describe_slots(split: Split, per: str = "") -> str:
    """``64 slots (16 heavy + 16 recent + 32 recall)``; ``48 slots (4 sinks + 22 heavy + 22 recent)``;
    ``per`` follows the word slots (`` per layer and KV head``)."""
    if split.grows:
        return f"{amount(split.slots.total)} slots{per}, growing with the text (a full cache: nothing evicted)"
    shown = [f"{amount(value)} {name}" for name, value in split.slots.items() if value or name in ("heavy", "recent")]
    return f"{amount(split.slots.total)} slots{per} ({' + '.join(shown)})"


def describe_use(split: Split) -> str:
    """``87/1638 slots held: 4/4 sinks + 40/815 heavy + 43/815 recent``: in use / capacity, per part."""
    held = split.held or Parts()
    head = f"{amount(held.total)}/{amount(split.slots.total)} slots held"
    if split.grows:
        return head + " (a full cache: it grows)"
    shown = [f"{amount(getattr(held, name))}/{amount(value)} {name}" for name, value in split.slots.items()
             if value or name in ("heavy", "recent")]
    return f"{head}: {' + '.join(shown)}"


@dataclass(frozen=True)
class Memory:
    reserved: int  # bytes of key and value slots allocated, whatever they hold
    in_use: int  # of which slots holding a token
    full: int  # what a cache without eviction would hold for the tokens seen
    per_slot: int | None = None  # one slot of every layer, over its KV heads (codes and scales counted)
    kv_dtype: str = "auto"  # how the slots hold keys and values (--kv-dtype)


def kv_memory(cache, layers: list[Split] | None = None) -> Memory:
    """The three byte counts (``layers``: ``layer_splits`` when already read). In use: the slots
    holding a token times a slot's key and value bytes, per layer."""
    layers = layer_splits(cache) if layers is None else layers
    in_use = 0
    for layer, split in zip(cache.layers, layers):
        if layer.is_initialized:
            in_use += round(split.held.total * split.rows) * layer.format.slot_bytes  # one KV head's slot
    return Memory(cache.kv_bytes(), in_use, cache.full_kv_bytes(), cache.kv_bytes_per_slot(),
                  getattr(cache, "kv_dtype", "auto"))


def describe_memory(memory: Memory) -> str:
    """``KV 3.80 MiB in use of 71.98 MiB reserved (a full cache: 3.82 MiB)``: early in a text the
    reserve is larger than a full cache would be; what is used never is."""
    text = (f"KV {format_bytes(memory.in_use)} in use of {format_bytes(memory.reserved)} reserved "
            f"(a full cache: {format_bytes(memory.full)})")
    if memory.kv_dtype != "auto" and memory.per_slot:  # slots not in the model's dtype: what one costs
        text += f", {memory.kv_dtype} slots of {format_bytes(memory.per_slot)}"
    return text


def _number(value: float) -> float | int:
    return int(value) if value == int(value) else round(value, 2)


def split_record(split: Split, memory: Memory) -> dict:
    """The split and the bytes for --json records."""
    return {
        "kv_slots": _number(split.slots.total),
        **{f"{'sink' if name == 'sinks' else name}_slots": _number(value) for name, value in split.slots.items()},
        "slots_held": {name: _number(value) for name, value in (split.held or Parts()).items()},
        "kv_bytes": memory.reserved,
        "kv_bytes_in_use": memory.in_use,
        "full_kv_bytes": memory.full,
        "slots_counted": "per layer, sequence and KV head, averaged over layers (recall slots are device slots of "
                         "the budget)",
        "kv_bytes_means": "kv_bytes: key and value slots reserved (allocated, whatever they hold); kv_bytes_in_use: "
                          "of which holding a token; full_kv_bytes: what a cache without eviction would hold for the "
                          "tokens seen",
    }


def evicted_per_head(cache: H2OCache, evicted: int | None = None) -> float:
    """Tokens evicted so far, averaged over (layer, sequence, KV head): 'how many tokens are gone'.
    ``evicted``: the cache's total when already read (``cache.evicted_tokens()``)."""
    rows = sum(layer.evicted.numel() for layer in cache.layers if layer.is_initialized)
    total = cache.evicted_tokens() if evicted is None else evicted
    return total / rows if rows else 0.0
