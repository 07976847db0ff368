"""The host-side counters of a cache: what a decode step reads instead of the device.

One ``HostCounters`` object per cache, made by the cache and held by reference: the cache's prefix
views (``H2OCache.prefix``, the server's decode buckets) share it with the cache they view, and each
layer holds its own ``LayerCounters`` inside it (the layers of a view hold the viewed layers'), so a
step of a view and a step of its cache advance the same numbers and nothing is handed over around a
step. ``saved()`` freezes them (``SavedHostCounters``: what ``H2OCache.restore_host_counters`` puts
back).

Its writers, and no others:
- the layer's step (``H2OLayer``: its insert, eviction and chunk selection, ``count_decoded``, which
  ``H2OCache.compiled_decode`` calls on its exit) and its ``allocate``/``reset``;
- the cache's numbering of a step (``H2OCache.position_ids``/``_begin_step``: the bound on positions)
  and its re-numbering (``_make_room``: the bound and the count of re-numberings);
- the cache's row moves (``kv.row_moves``: ``import_row``, ``reset_row(s)``, ``assume_seen``) and
  ``kv.synthetic.fill_recent``;
- ``H2OCache.restore_host_counters`` (decode steps that fed no row at all: ``generation.stream``'s
  bursts, the server's warm-up).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerCounters:
    """One layer's: slot columns holding a token or padding (the same for every row and head), and
    columns fed, padding included."""

    slots_in_use: int = 0
    tokens_fed_with_padding: int = 0

    def set(self, slots_in_use: int, tokens_fed_with_padding: int) -> None:
        self.slots_in_use, self.tokens_fed_with_padding = slots_in_use, tokens_fed_with_padding

    def values(self) -> tuple[int, int]:
        return self.slots_in_use, self.tokens_fed_with_padding


@dataclass(frozen=True)
class SavedHostCounters:
    """The host counters at one moment (``HostCounters.saved``)."""

    largest_next_position: int
    compactions: int
    layers: tuple[tuple[int, int], ...]  # each layer's (slots_in_use, tokens_fed_with_padding)


@dataclass
class HostCounters:
    """A cache's host counters, shared by reference with its prefix views (see the module's docstring).
    ``largest_next_position``: the largest next position of any row (an upper bound after a step that
    left rows out); ``compactions``: re-numberings so far; ``layers``: each layer's."""

    layers: list[LayerCounters]
    largest_next_position: int = 0
    compactions: int = 0

    def bound_positions(self, largest_next_position: int) -> None:
        self.largest_next_position = largest_next_position

    def count_compactions(self, compactions: int) -> None:
        self.compactions = compactions

    def saved(self) -> SavedHostCounters:
        return SavedHostCounters(self.largest_next_position, self.compactions,
                                 tuple(layer.values() for layer in self.layers))

    def restore(self, saved: SavedHostCounters) -> None:
        """Put back ``saved`` after steps that changed nothing on the device; a re-numbering since
        keeps its own (exact) bound on positions."""
        if saved.compactions == self.compactions:
            self.largest_next_position = saved.largest_next_position
        for layer, values in zip(self.layers, saved.layers):
            layer.set(*values)

    def clear(self) -> None:
        """An empty cache's (in place: the views sharing these see it too)."""
        self.largest_next_position = self.compactions = 0
        for layer in self.layers:
            layer.set(0, 0)
