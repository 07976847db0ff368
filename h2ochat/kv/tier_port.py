"""The tier port: what a layer hands its tier, and the one place that knows where the tier's slot
columns are.

A layer's per-slot tensors ([B, Hkv, S, ...]: its slot format's keys and values (and scales), the
scores, token indices and positions) hold ``capacity`` policy columns first and the tier's
``columns`` after them; a tier that stages (recall) stages in its last page. That layout is said
here alone: a tier asks the port for its columns as named views (``tier_columns``, ``frame_columns``,
``staging_columns``), for a victim's values before the eviction overwrites it (``victims``), writes
its staged entries through it (``write_staged``), and a
reader outside the layer (``split``, ``kv.row_moves``) splits a per-slot tensor with ``policy_part``
and ``tier_part``. A tier reads nothing else of its layer: its host counters, its kernels, its slot
format and its policy's decay come through the port too.
"""

from __future__ import annotations

import torch

from .host_counters import LayerCounters


POLICY_BOOKKEEPING = ("scores", "value_norm")  # what a slot holds for the policy alone


def columns_of(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``tensor[:, :, start:stop]`` as a tensor of its own over the same memory, without an autograd base.
    A compiled step that writes both a layer's slots and a tier's columns has inputs that alias; its graph
    then takes one base per storage, shaped like the views' ``_base`` where they have one (views made
    outside inference mode: a server's cache) and flat where they have none (made inside: a chat's or a
    bench's). Inductor's disk cache does not key on which, so a step compiled by the one and read back by
    the other failed on its first call; without a base, every caller's views take the flat one. (A compiled
    recall step writes its staging page through the layer's tensors, ``write_staged``: no such inputs.)"""
    view = tensor[:, :, start:stop]
    if torch.compiler.is_compiling():  # (in a graph: a view of the layer's own input, no input of its own)
        return view
    with torch.inference_mode(tensor.is_inference()):  # (the same kind of tensor as its layer's: one graph)
        alias = torch.empty(0, dtype=view.dtype, device=view.device)
        return alias.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


class TierPort:
    """One layer's side of its tier: made by the layer at allocation (``H2OLayer.allocate``)."""

    def __init__(self, capacity: int, columns: int, tensors: dict[str, torch.Tensor],
                 counters: LayerCounters, *, coordinates, slot_format, kernels, rows, layer: int):
        self.capacity, self.columns = capacity, columns  # the policy's columns, then the tier's
        self.layer = layer  # the layer's index in its cache
        # the layer's per-slot tensors by name, handed over, not fetched: the layer makes a new port whenever
        # it replaces them, and a port holding its layer (or a method of it) would make every cache a reference
        # cycle, whose buffers wait for Python's cycle collector (a server's 1-row prompt caches held ~230 MB so)
        self._slot_tensors = dict(tensors)
        self._counters = counters
        self.coordinates = coordinates  # (sequence, head) index tensors: one slot per (sequence, KV head)
        self.format = slot_format  # ``kv.slot_format``: how the columns hold keys and values
        self.kernels = kernels  # the layer's ``Backend``
        self._rows = rows  # the policy's per-row parameters (``kv.rows.RowParameters``)

    # -- the layout ---------------------------------------------------------------------------------
    def tier_columns(self, start: int = 0, stop: int | None = None) -> dict[str, torch.Tensor]:
        """Views of the tier's columns [start, stop) (counted from its first; None: to its last) of
        every per-slot tensor: the format's (keys, values, scales), scores, token_index, positions (and
        value_norm, for a policy that ranks by it)."""
        stop = self.columns if stop is None else stop
        if not 0 <= start <= stop <= self.columns:
            raise ValueError(f"tier columns [{start}, {stop}) outside the tier's {self.columns}")
        begin = self.capacity
        return {name: columns_of(tensor, begin + start, begin + stop) for name, tensor in self._slot_tensors.items()}

    def policy_columns(self) -> dict[str, torch.Tensor]:
        """Views of the policy's columns of every per-slot tensor (where ``victims`` reads)."""
        return {name: columns_of(tensor, 0, self.capacity) for name, tensor in self._slot_tensors.items()}

    def frame_columns(self, page: int) -> dict[str, torch.Tensor]:
        """The tier's columns before its last page (recall's frames of recalled pages)."""
        return self.tier_columns(0, self.columns - page)

    def staging_columns(self, page: int) -> dict[str, torch.Tensor]:
        """The tier's last ``page`` columns (recall stages its evicted tokens there)."""
        return self.tier_columns(self.columns - page)

    def write_staged(self, page: int, entry: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """``values`` by name ([B, Hkv, ...]: some of the per-slot tensors) into entry ``entry`` [B, Hkv] of
        each (sequence, KV head)'s staging page (the tier's last ``page`` columns), written by index into the
        layer's tensors themselves: in a compiled step a write into a view of a graph input (a
        ``staging_columns`` view) was rebuilt as a copy of the whole keys and values with the page scattered
        back, which inductor kept in place in some layers and not in others (SmolLM2-135M, fp32, 8 rows,
        256 slots: ~0.9 ms a layer in half of them, 12% of the step)."""
        where = (*self.coordinates, entry + (self.capacity + self.columns - page))
        for name, value in values.items():
            self._slot_tensors[name].index_put_(where, value)

    def policy_part(self, tensor: torch.Tensor) -> torch.Tensor:
        """The policy's columns of a per-slot tensor whose last dimension is the slot column."""
        return tensor[..., :self.capacity]

    def tier_part(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tier's columns of a per-slot tensor whose last dimension is the slot column."""
        return tensor[..., self.capacity:]

    def slot_tensors(self) -> list[torch.Tensor]:
        """The layer's whole per-slot tensors a tier may write (not the policy's bookkeeping), in a
        fixed order: what an opaque op that writes the tier's columns declares it writes."""
        return [tensor for name, tensor in self._slot_tensors.items() if name not in POLICY_BOOKKEEPING]

    def victims(self, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        """What slot ``slot`` [B, Hkv] (a policy column) of each (sequence, KV head) holds, by name
        (the format's tensors, token_index, positions; not the policy's scores): what a decode
        step's eviction is about to overwrite (read before it does)."""
        where = (*self.coordinates, slot)
        return {name: tensor[where] for name, tensor in self._slot_tensors.items()
                if name not in POLICY_BOOKKEEPING}

    # -- what else a tier may read of its layer -----------------------------------------------------
    @property
    def batch(self) -> int:
        """The rows this layer steps: a prefix cache's first rows of the tier's (``H2OCache.prefix``)."""
        return self._slot_tensors["token_index"].shape[0]

    @property
    def tokens_fed_with_padding(self) -> int:
        """Columns fed so far, padding included (a host int: an upper bound of any row's tokens)."""
        return self._counters.tokens_fed_with_padding

    @property
    def decay(self):
        """The policy's score decay (a float, or [B] per row): how a tier weighs a step's attention."""
        return self._rows.decay

    @property
    def inference(self) -> bool:
        """Whether the slots were made under inference mode (a tier's eager work runs in the same)."""
        return self._slot_tensors["token_index"].is_inference()
