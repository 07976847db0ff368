"""A CPU decode step's recall work for one layer in one C call (``h2ochat_recall_step``, ``csrc/recall_step.h``,
bound by ``recall_ops``): the best pages, the frames' plan, the loaded pages' copy and, with ``--recall-rest``,
the step's rest column from the same q.k.

- ``DecodeChoice``: the call, where it runs (the exact selector on the store's own bf16 or fp32 keys, a store
  that never wraps, keys not to turn); elsewhere the caller keeps its torch routes.
- ``PageMeans``: each full cold page's mean value, which the rest weighs every step. A full page's values
  never change (the store only appends; a row's reset or import starts its means again: ``forget``), so
  each is computed once, when the C call first finds the page full, instead of every step from the values:
  that took 2.6 of the 3.5 ms the rest added to SmolLM2's step at 2K tokens (budget 128, recall 64). fp32,
  value_dim * 4 / page host bytes a token and head (32 at a head dim of 64 and pages of 8: the cold store's
  int8 values and bf16 keys take 208), counted with the tier's host bytes.
"""

from __future__ import annotations

import torch

from .recall_ops import FLOATS, TINY_SCALE, Kernels, StorePlaces, bound, host_rows, row_bytes, slot_scales, strided


class PageMeans:
    """The mean values [B, H, N, Dv] fp32 of each row's first ``meaned`` [B, H] full pages (the C call
    fills them as pages fill; room for N pages grows by doubling, the means kept). ``used``: whether the
    tier's C call will keep them (its host bytes a token are counted from the start)."""

    def __init__(self, batch: int, heads: int, value_dim: int, used: bool):
        self.means = torch.empty(batch, heads, 0, value_dim)
        self.meaned = torch.zeros(batch if used else 0, heads, dtype=torch.long)  # (unused: no byte at all)
        self.used = used

    def room(self, pages: int) -> None:
        """Room for ``pages`` pages a row."""
        held = self.means.shape[2]
        if held >= pages:
            return
        grown = torch.empty(*self.means.shape[:2], max(pages, 2 * held), self.means.shape[3])
        grown[:, :, :held] = self.means
        self.means = grown

    def forget(self, row: int) -> None:
        """Row ``row`` holds other values now (reset, or imported): its means are computed again."""
        if self.used:
            self.meaned[row] = 0

    def nbytes(self) -> int:
        return self.means.numel() * self.means.element_size() + self.meaned.numel() * self.meaned.element_size()

    def written_nbytes(self) -> int:
        """Of ``nbytes``, the means the rows hold (room past them is never written: not in memory)."""
        meaned = self.meaned
        return int(meaned.sum()) * self.means.shape[3] * self.means.element_size() + meaned.numel() * meaned.element_size()

    def bytes_per_token(self, page: int) -> float:
        """Host bytes one cold token of one row will take here, over the KV heads (0 where they are not used)."""
        return self.means.shape[1] * self.means.shape[3] * self.means.element_size() / page if self.used else 0.0


class DecodeChoice:
    """One layer's whole choice of a step in one C call: the best pages (``recall_ops.top_pages``), the frames'
    plan (``recall_ops.frames_update``, the store's full pages complete) and the loaded pages' copy
    (``recall_ops.fill_frames``), where all three run: the exact selector on the store's own keys, a store that
    never wraps, bf16 or fp32 keys, slots of their dtype or 8-bit codes, keys not to turn; every row choosing,
    or some (``rows``: the others keep their frames, clocks and slots). With a rest scale, every row's rest
    column too (``recall.rest``'s, from the q.k the choice computed). ``of`` says whether it takes a layer; a
    call returns False where it does not take this step."""

    def __init__(self, kernels: Kernels, cold, frames, slots: dict[str, torch.Tensor], scales):
        self.kernels, self.cold, self.frames = kernels, cold, frames
        names = ("keys", "values", "token_index", "positions")
        self.targets = strided(kernels, [slots[name] for name in names])
        self.scales = scales  # (quantized slots' scales and offsets, ``recall_ops.slot_scales``; None: float slots)
        self._slots = slots  # (the views the targets point into, held while they are)
        # (the slots' float dtype, or what codes are made from: the model's either way)
        self.value_dim, self.value_bytes = slots["values"].shape[-1], cold.dtype.itemsize
        shape = frames.frame_page.shape
        self.wanted = torch.empty(shape, dtype=torch.long)
        self.load = torch.empty(shape, dtype=torch.bool)
        # the frames' state and these outputs stay where they are: their pointers once
        self.state = [t.data_ptr() for t in (self.wanted, frames.frame_page, frames.last_used, frames.clock,
                                             frames.copied, frames.complete, self.load)]
        self.store, self.sources = StorePlaces(), None  # the store's places the sources point into (grown: new ones)
        self.rest_out = self.rest = None  # (the rest's logit [B, H, M, 1] and value [B, H, M, 1, Dv]; the last call's)

    @classmethod
    def of(cls, cold, frames, slots: dict[str, torch.Tensor], keys_in_place: bool) -> "DecodeChoice | None":
        kernels = bound()
        keys, values = slots["keys"], slots["values"]
        state = (frames.frame_page, frames.last_used, frames.clock, frames.copied, frames.complete)
        scales = slot_scales(slots, cold.keys.shape[-1], cold.values.shape[-1])
        dtype = cold.dtype  # (the model's: the slots'; the store's keys are bf16 or of it)
        if (kernels is None or not keys_in_place or cold.frames is not None or cold.quantized_keys or cold.zero_copy
                or scales is False or dtype not in FLOATS or cold.keys.dtype not in FLOATS
                or (scales is None and (keys.dtype != dtype or values.dtype != dtype))
                or cold.values.dtype != (torch.int8 if cold.quantized_values else dtype)
                or not host_rows(*state) or any(t.device.type != "cpu" or t.stride(-1) != 1 for t in (keys, values))
                or slots["token_index"].dtype != torch.long or slots["positions"].dtype != torch.long):
            return None
        return cls(kernels, cold, frames, slots, scales)

    def __call__(self, queries: torch.Tensor, scored: int, rows: bool | list[bool] = True,
                 rest: tuple[float, PageMeans] | None = None) -> bool:
        """The step's choice for ``queries`` [B, H, M, D] over the store's first ``scored`` slots, by the
        rows ``rows`` (True: every row; False: none; else a boolean per row). ``rest``: the attention's scale
        and the tier's page means, and every row's rest column left in ``rest`` from the same q.k, as a decode
        step's attention takes it ([B, H, M, 1], [B, H, M, 1, Dv]; None while no row holds a cold token)."""
        if queries.dtype != self.cold.dtype or torch.compiler.is_compiling():
            return False
        choosing = None if rows is True else row_bytes(rows if rows is not False else [False] * queries.shape[0])
        cold = self.cold
        queries = queries.contiguous()  # (an fp32 model's queries for bf16 keys: the C call rounds them, as
        # ``ColdStore.scored_queries`` would: one op less a layer)
        batch, heads, count, dim = queries.shape
        buffers = (cold.keys, cold.values, cold.token_index, cold.positions, cold.value_scale)
        if not self.store.holds(buffers):
            self.sources = strided(self.kernels, buffers)
            self.store.record(buffers)
        scale, means = rest if rest is not None else (0.0, None)
        if means is not None:
            means.room(scored // cold.page)
            if self.rest_out is None or self.rest_out[0].shape[:3] != queries.shape[:3]:  # (as the attention takes them)
                self.rest_out = (torch.empty(*queries.shape[:3], 1), torch.empty(*queries.shape[:3], 1, self.value_dim))
        pointers = [None, None, None, 0, None] if means is None else [*(t.data_ptr() for t in self.rest_out), means.means.data_ptr(),
                                                     means.means.shape[2], means.meaned.data_ptr()]
        holding = self.kernels.recall_step(
            queries.data_ptr(), batch, heads, count, dim, cold.count.data_ptr(), scored, cold.page,
            self.frames.frame_page.shape[-1], *self.state, self.sources, self.targets, self.value_dim, self.value_bytes,
            None if choosing is None else choosing.data_ptr(), self.scales, TINY_SCALE, scale, *pointers,
            cold.keys.element_size(), queries.element_size())
        if holding < 0:  # (its scratch did not fit in memory: nothing written)
            return False
        self.rest = self.rest_out if means is not None and holding else None
        return True

    def rest_as(self, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last call's rest as the attention takes it for queries [B, H, G, Q] (``shape``) handed to the call
        group-major (G * Q of them): logit [B, H, G, Q] and value [B, H, G, Q, Dv]; None where it left none."""
        return None if self.rest is None else (self.rest[0].view(shape), self.rest[1].view(*shape, self.value_dim))
