"""The cold store's writes in C (``csrc/store_writes.h``, bound by ``recall_ops``): an append of evicted tokens
(``cold_append``, ``ColdStore.append``'s), and a staging page's whole flush (``Flusher``,
``RecallTier.flush``'s: the rows' entries appended, their columns emptied and their count zeroed, one call
a layer). A server's rows flush on their own cadences, so some row flushes at nearly every step, and every
layer's flush went through a dozen small torch ops: milliseconds of host work a step. Each returns None or False where it does not take the tensors
(no kernel, another device or dtype, quantized slots): the caller keeps its torch route, which
tests/test_recall_native.py holds these to, bit for bit.
"""
from __future__ import annotations

import torch

from . import recall_ops
from .recall_ops import StorePlaces, host_rows, row_bytes, strided

PAGE_NAMES = ("keys", "values", "token_index", "positions")  # what an append reads, by name
STORE_NAMES = ("keys", "values", "token_index", "positions", "encoded", "value_scale")  # what it writes, in order


def _takes(new: dict[str, torch.Tensor], store: dict[str, torch.Tensor | None], count: torch.Tensor) -> bool:
    """Whether the C append takes entries ``new`` into ``store`` (see ``cold_append``)."""
    keys, values, scale = new["keys"], new["values"], store["value_scale"]
    stored = [store[name] for name in STORE_NAMES[:5]]
    quantized = scale is not None
    return not (not host_rows(count) or count.dtype != torch.long
                or any(t.device.type != "cpu" or t.stride(-1) != 1 for t in (keys, values, *stored[:2]))
                or keys.dtype not in recall_ops.FLOATS or stored[0].dtype not in recall_ops.FLOATS
                or (values.dtype not in recall_ops.FLOATS if quantized
                    else values.dtype != stored[1].dtype)
                or (quantized and (stored[1].dtype != torch.int8 or scale.dtype != torch.float32))
                or any(t.dtype != torch.int32 for t in stored[2:])
                or new["token_index"].dtype != torch.long or new["positions"].dtype != torch.long
                or any(t.device.type != "cpu" for t in (new["token_index"], new["positions"])))


def _targets(kernels, store: dict[str, torch.Tensor | None]):
    return strided(kernels, [store[name] for name in STORE_NAMES])


def _sizes(new: dict[str, torch.Tensor]) -> tuple[int, int, int, int]:
    keys, values = new["keys"], new["values"]
    return keys.shape[-1], keys.element_size(), values.shape[-1], values.element_size()


def cold_append(new: dict[str, torch.Tensor], store: dict[str, torch.Tensor | None], count: torch.Tensor,
                capacity: int) -> torch.Tensor | None:
    """``ColdStore.append`` of ``new`` (keys, values [B, H, E, ...], token_index, positions [B, H, E] int64) into a
    store that never wraps, room reserved: ``store``'s keys (bf16 or fp32: fp32 keys rounded to bf16 ones), values
    (the new values' dtype, or int8 codes with ``value_scale``: of bf16 or fp32 values), token_index, positions and
    encoded (int32); ``count`` [B, H] advanced. The slots written [B, H, E] (-1: none), or None where it does not
    take these."""
    kernels = recall_ops.bound()
    if kernels is None or torch.compiler.is_compiling() or not _takes(new, store, count):
        return None
    batch, heads, entries = new["token_index"].shape
    sources = strided(kernels, [new[name] for name in PAGE_NAMES])
    slots = torch.empty(batch, heads, entries, dtype=torch.long)
    kernels.cold_append(batch, heads, entries, count.data_ptr(), capacity, sources, _targets(kernels, store), *_sizes(new),
                        store["keys"].element_size(), slots.data_ptr())
    return slots


class Flusher:
    """One layer's staging page (``page``: its float columns by name, [B, H, P, ...]; ``staged`` [B, H]: its
    entry counts) flushed into a cold store in one C call (``h2ochat_flush``). The page's pointers are taken
    once (its columns are views of the layer's slots, which stay where they are), the store's again when its
    buffers move (a store that grew past its room has new ones; ``recall_ops.StorePlaces``). ``of`` says whether it
    takes the page."""

    def __init__(self, kernels, page: dict[str, torch.Tensor], staged: torch.Tensor):
        self.kernels, self.staged = kernels, staged
        self.entries = page["token_index"].shape[-1]
        self.sources = strided(kernels, [page[name] for name in PAGE_NAMES])
        self.sizes = _sizes(page)
        self._page = page  # (the views the sources point into, held while they are)
        self.store, self.targets = StorePlaces(), None

    @classmethod
    def of(cls, page: dict[str, torch.Tensor], staged: torch.Tensor,
           store: dict[str, torch.Tensor | None], count: torch.Tensor) -> "Flusher | None":
        kernels = recall_ops.bound()
        if (kernels is None or set(page) != set(PAGE_NAMES) or not host_rows(staged) or staged.dtype != torch.long
                or not _takes(page, store, count)):
            return None
        return cls(kernels, page, staged)

    def __call__(self, store: dict[str, torch.Tensor | None], count: torch.Tensor, capacity: int,
                 rows: list[bool] | None = None) -> bool:
        """The page's entries of ``rows`` (a boolean per row; None: every row) appended to ``store`` (room
        reserved; ``count`` [B, H] advanced), then those rows' columns emptied and their counts zeroed.
        False, having done nothing, where it does not take this store (its buffers changed kind)."""
        buffers = [store[name] for name in STORE_NAMES]
        if not self.store.holds(buffers):
            if torch.compiler.is_compiling() or not _takes(self._page, store, count):
                return False
            self.targets = _targets(self.kernels, store)
            self.store.record(buffers)
        batch, heads = count.shape
        mask = None if rows is None else row_bytes(rows)
        self.kernels.flush(batch, heads, self.entries, None if mask is None else mask.data_ptr(), count.data_ptr(),
                           capacity, self.sources, self.targets, *self.sizes, store["keys"].element_size(),
                           self.staged.data_ptr())
        return True
