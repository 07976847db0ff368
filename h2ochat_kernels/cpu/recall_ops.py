"""The recall step's CPU kernels (``csrc/recall_*``), for a step whose cold store is in the same memory: what
each entry point computes, the tensors it takes, and the checks that keep every route equal to the torch one.

The variant that runs is ``routes.cpu_route("recall")``'s: ``avx512bf16`` (bf16 scored by VDPBF16PS,
``Kernels.bf16_dots``), ``avx2`` or ``generic`` (vectors of 8 floats). Every variant takes bf16 and fp32
queries and keys (a model's dtype).

- ``page_best`` / ``top_pages``: the exact selector's page scores, read straight from the keys: the torch
  reference's (``recall_reference.page_scores``) up to the order the fp32 sums are added in. Up to a decode
  step's 8 queries score as the largest of each alone, bit for bit, on every variant.
- ``frames_update``: ``RecallFrames.update``'s plan, op for op; ``fill_frames``: the loaded pages into the
  recall slots (float slots, or int8 codes encoded as ``slot_format.encode`` does, bit for bit); ``Stager``: a
  decode step's victim into the staging page. The cold store's writes are ``store_ops``'; a step's whole
  choice in one call is ``decode_choice.DecodeChoice``.

Each variant is checked against the torch reference the first time it loads, in both dtypes; one that
disagrees is never used. Where no variant runs (``H2OCHAT_CPU_KERNELS=none``, an install without a C
compiler, a GPU's tensors, a compiled graph), every function here returns None or False and the caller keeps
its torch route, with the same results. tests/test_recall_native.py holds each entry to the route it
replaces, on every variant this CPU runs.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..quant import SCALE_TENSORS, level_codes
from ..recall_reference import page_scores as reference_page_scores
from ..recall_reference import top_pages as kernels_top_pages
from . import routes, variants
from .binding import Library

FLOATS = (torch.bfloat16, torch.float32)  # the dtypes the kernels read queries, keys and float slots in
# the least scale quantized slots take (a slot of equal values: ``level_codes``' clamp), for the C route's codes
TINY_SCALE = float(level_codes(torch.zeros(1, 1), 8)[1])


@dataclass(frozen=True)
class Kernels:
    library: Library
    bf16_dots: bool  # the avx512bf16 variant (bf16 scored by VDPBF16PS)
    page_best: object
    top_pages: object
    frames_update: object
    fill_frames: object
    recall_step: object
    stage: object
    cold_append: object
    flush: object


def strided(kernels: Kernels, tensors) -> object:
    """The C array of ``strided_t`` for ``tensors`` (a buffer's base and its (sequence, head, slot) strides in
    elements; a None tensor: NULL and zeros)."""
    cast = kernels.library.ffi.cast
    return kernels.library.array("strided_t", [(cast("void *", 0), 0, 0, 0) if t is None
                                               else (cast("void *", t.data_ptr()), *t.stride()[:3]) for t in tensors])


def _bind(library: Library) -> Kernels:
    return Kernels(library=library, bf16_dots=bool(library.h2ochat_bf16_dots()),
                   page_best=library.h2ochat_page_best, top_pages=library.h2ochat_top_pages,
                   frames_update=library.h2ochat_frames_update, fill_frames=library.h2ochat_fill_frames,
                   recall_step=library.h2ochat_recall_step, stage=library.h2ochat_stage,
                   cold_append=library.h2ochat_cold_append, flush=library.h2ochat_flush)


def _scoring(queries, keys) -> list:
    """The arguments the scoring kernels share: queries (contiguous) and the keys' view."""
    batch, heads, count, dim = queries.shape
    return [queries.data_ptr(), batch, heads, count, dim, keys.data_ptr(), keys.stride(0), keys.stride(1),
            keys.stride(2)]


def _call_page_best(kernels: Kernels, queries, keys, valid, page) -> torch.Tensor | None:
    tokens, queries, valid = keys.shape[2], queries.contiguous(), valid.contiguous()
    out = torch.empty(*queries.shape[:2], tokens // page, dtype=torch.float32)
    done = kernels.page_best(*_scoring(queries, keys), valid.data_ptr(), tokens, page, out.data_ptr(),
                             keys.element_size())
    return out if done else None


def _call_top_pages(kernels: Kernels, queries, keys, count, page, k) -> torch.Tensor | None:
    tokens, queries, count = keys.shape[2], queries.contiguous(), count.contiguous()
    k = min(k, tokens // page)
    wanted = torch.empty(*queries.shape[:2], k, dtype=torch.long)
    done = kernels.top_pages(*_scoring(queries, keys), count.data_ptr(), tokens, page, k, wanted.data_ptr(),
                             keys.element_size())
    return wanted if done else None


def _agrees_with_torch(kernels: Kernels) -> bool:
    """Odd sizes (a head dim with a tail of 32, a view with gaps), some slots invalid, an empty page, a few
    queries and a chunk's many, bf16 and fp32: against the torch reference, within fp32 rounding."""
    return all(_agrees_in(kernels, dtype) for dtype in FLOATS)


def _agrees_in(kernels: Kernels, dtype: torch.dtype) -> bool:
    generator = torch.Generator().manual_seed(0)
    store = torch.randn(2, 3, 50, 72, generator=generator).to(dtype)
    keys = store[:, :, :40, :67]
    queries = torch.randn(2, 3, 5, 67, generator=generator).to(dtype)
    valid = torch.rand(2, 3, 40, generator=generator) > 0.3
    valid[:, :, 8:16] = False
    got = _call_page_best(kernels, queries, keys, valid, 8)
    expected = reference_page_scores(queries, keys, None, None, valid, 8)
    agrees = (got is not None and bool(torch.allclose(got, expected, rtol=1e-5, atol=1e-4))
              and bool((got[:, :, 1] == float("-inf")).all()))
    count = torch.tensor([[0, 1, 17], [23, 40, 39]])
    slots = torch.arange(40)
    scores = reference_page_scores(queries, keys, None, None, slots < count.unsqueeze(-1), 8)
    wanted = _call_top_pages(kernels, queries, keys, count, 8, 4)
    agrees = agrees and wanted is not None and torch.equal(wanted, kernels_top_pages(scores, 4))
    many = torch.randn(2, 3, 21, 67, generator=generator).to(dtype)  # (a chunk's: by blocks of keys)
    got = _call_page_best(kernels, many, keys, valid, 8)
    expected = reference_page_scores(many, keys, None, None, valid, 8)
    return agrees and got is not None and bool(torch.allclose(got, expected, rtol=1e-5, atol=1e-4))


def _checked(library: Library) -> Kernels | None:
    kernels = _bind(library)
    return kernels if _agrees_with_torch(kernels) else None


def _loaded(variant: variants.Variant | None = None) -> tuple[Kernels | None, str]:
    """(the bound kernels of the route that runs here, or of ``variant``, "") or (None, why none does)."""
    return routes.cpu_checked("recall", _checked, variant)


def bound() -> Kernels | None:
    """The bound kernels, or None where they are not used (``why_not`` says why)."""
    return _loaded()[0]


def available() -> bool:
    return _loaded()[0] is not None


def why_not() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    return _loaded()[1]


def page_best(queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, page: int) -> torch.Tensor | None:
    """``recall_reference.page_scores(queries, keys, None, None, valid, page)`` (queries [B, H, M, D],
    keys [B, H, T, D] bf16 or fp32, one dtype, on the CPU, unit stride along D, valid [B, H, T]) from the C
    kernel (a few queries 16 or 8 keys at a time, more by blocks of keys: a prompt chunk's); None where it does not take
    these (another dtype or device, no kernel): the caller's torch reference then."""
    kernels = _taking(queries, keys, page)
    return None if kernels is None else _call_page_best(kernels, queries, keys, valid.to(torch.bool), page)


def top_pages(queries: torch.Tensor, keys: torch.Tensor, count: torch.Tensor, page: int, k: int) -> torch.Tensor | None:
    """The best ``k`` pages [B, H, min(k, T // P)] of a store that never wraps (``keys`` [B, H, T, D] its
    first T slots, ``count`` [B, H] int64 the tokens each row and head holds: slot n < count holds the
    n-th), best first, -1 where fewer pages hold a token: ``top_pages`` of ``page_best``'s scores with
    the slots below ``count`` valid, in one call (None as ``page_best``)."""
    kernels = _taking(queries, keys, page)
    if kernels is None or count.dtype != torch.long or count.device.type != "cpu":
        return None
    return _call_top_pages(kernels, queries, keys, count, page, k)


def _taking(queries: torch.Tensor, keys: torch.Tensor, page: int) -> Kernels | None:
    """The kernels, where they take these queries and keys."""
    if not (keys.dtype == queries.dtype and keys.dtype in FLOATS and keys.device.type == "cpu"
            and queries.device.type == "cpu" and keys.stride(-1) == 1
            and keys.shape[2] % page == 0 and not torch.compiler.is_compiling()):
        return None
    return _loaded()[0]


def host_rows(*tensors: torch.Tensor) -> bool:
    """Contiguous CPU tensors (state the kernels write through their pointers), outside a compiled graph."""
    return not torch.compiler.is_compiling() and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def frames_update(wanted: torch.Tensor, frame_page, last_used, clock, copied, complete,
                  complete_pages: torch.Tensor | None) -> torch.Tensor | None:
    """``RecallFrames.update``'s state change (its tensors, updated in place) in one call: the frames
    that load a page [B, H, F] bool; None where the kernel does not take them (the caller's torch route)."""
    kernels = _loaded()[0]
    state = (frame_page, last_used, clock, copied, complete)
    if kernels is None or not host_rows(*state) or complete.dtype != torch.bool or any(
            t.dtype != torch.long for t in state[:4]):
        return None
    wanted = wanted.to(torch.long).contiguous()
    if complete_pages is not None:
        complete_pages = complete_pages.to(torch.long).contiguous()
    rows, frames = frame_page.shape[0] * frame_page.shape[1], frame_page.shape[2]
    load = torch.empty(frame_page.shape, dtype=torch.bool)
    kernels.frames_update(rows, frames, wanted.shape[-1], wanted.data_ptr(), *(t.data_ptr() for t in state),
                          None if complete_pages is None else complete_pages.data_ptr(), load.data_ptr())
    return load


def slot_scales(slots: dict[str, torch.Tensor], head_dim: int, value_dim: int):
    """Quantized slots' scales and offsets as the kernels take them (``strided``: four); None for float slots;
    False where the kernels do not take these slots (codes of fewer bits than 8, scales not fp32 on the CPU)."""
    if "key_scale" not in slots:
        return None
    scales = [slots[name] for name in SCALE_TENSORS]
    keys, values = slots["keys"], slots["values"]
    if (keys.dtype != torch.uint8 or values.dtype != torch.uint8 or keys.shape[-1] != head_dim
            or values.shape[-1] != value_dim or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in scales)):
        return False
    kernels = bound()
    return False if kernels is None else strided(kernels, scales)


def fill_frames(slots: dict[str, torch.Tensor], store: dict[str, torch.Tensor | None], count: torch.Tensor,
                ring: int | None, page: int, load: torch.Tensor, frame_page: torch.Tensor, floats: torch.dtype) -> bool:
    """The loaded frames' pages from the cold store into the recall slots (``step.fill_recall_slots``
    for a plan read on the host), in one call: ``slots`` keys, values, token_index and positions
    [B, H, R, ...] (views of the layer's: float slots of the model's dtype ``floats``, or 8-bit codes with
    ``SCALE_TENSORS`` beside them, encoded as ``slot_format.encode`` does from ``floats``); ``store`` the same
    names [B, H, S, ...] (keys bf16 or of ``floats``, widened exactly; values of ``floats`` or int8 with
    ``value_scale``, token index and positions int32, keys at the positions they are attended at). False where
    the kernel does not take them (nothing written)."""
    kernels = _loaded()[0]
    keys, values = slots["keys"], slots["values"]
    scale = store.get("value_scale")
    scales = slot_scales(slots, store["keys"].shape[-1], store["values"].shape[-1])
    if (kernels is None or scales is False or torch.compiler.is_compiling() or store["keys"].dtype not in FLOATS
            or floats not in FLOATS or (scales is None and (keys.dtype != floats or values.dtype != floats))
            or store["values"].dtype != (torch.int8 if scale is not None else floats)
            or (scale is not None and scale.dtype != torch.float32)
            or any(t.device.type != "cpu" or (t.dim() == 4 and t.stride(-1) != 1) for t in (*slots.values(),
                                                                                        *store.values(), count)
                   if t is not None)
            or slots["token_index"].dtype != torch.long or slots["positions"].dtype != torch.long
            or store["token_index"].dtype != torch.int32 or store["positions"].dtype != torch.int32):
        return False
    load, frame_page, count = load.contiguous(), frame_page.contiguous(), count.contiguous()
    batch, heads, frames = load.shape
    names = ("keys", "values", "token_index", "positions")
    sources = strided(kernels, [*(store[name] for name in names), scale])
    targets = strided(kernels, [slots[name] for name in names])
    kernels.fill_frames(batch, heads, frames, page, load.data_ptr(), frame_page.data_ptr(), count.data_ptr(),
                        ring or 0, sources, targets, keys.shape[-1], store["keys"].dtype.itemsize, values.shape[-1],
                        floats.itemsize, scales, TINY_SCALE)
    return True


def store_places(buffers) -> tuple:
    """Where a store's buffers are (base and strides; None for one it lacks): what its ``Strided`` are made of, so
    equal places are equal pointers."""
    return tuple(None if tensor is None else (tensor.data_ptr(), tensor.stride()) for tensor in buffers)


class StorePlaces:
    """The places of the store buffers a C call's ``strided`` arrays were last made from (``record``), and whether
    some buffers are still there (``holds``). Places and weak references are kept, not the tensors: holding them
    kept the buffers a store had before it grew, narrowed or was imported over alive until that layer's next call
    (a server's peak memory). The places are read again only when the tensors are not the very ones recorded (a
    tensor keeps its storage and strides; the store replaces a tensor where it grows, narrows or is imported
    over), so the common call costs a few identity checks."""

    def __init__(self):
        self.places, self._refs = None, ()

    def holds(self, buffers) -> bool:
        if len(buffers) == len(self._refs) and all(
                ref is None if tensor is None else (ref is not None and ref() is tensor)
                for tensor, ref in zip(buffers, self._refs)):
            return True
        if store_places(buffers) != self.places:
            return False
        self._refs = _weakly(buffers)  # (new tensors in the same places: the same pointers)
        return True

    def record(self, buffers) -> None:
        self.places, self._refs = store_places(buffers), _weakly(buffers)


def _weakly(buffers) -> tuple:
    return tuple(None if tensor is None else weakref.ref(tensor) for tensor in buffers)


def row_bytes(rows: list[bool]) -> torch.Tensor:
    """One byte per row (1: the row takes part), for a kernel's row mask."""
    return torch.tensor(rows, dtype=torch.uint8)


def _extras(staging: dict[str, torch.Tensor]) -> list[str]:
    """The scales and offsets a quantized slot holds beside its codes (none for float slots)."""
    return [name for name in SCALE_TENSORS if name in staging]


class Stager:
    """``StagingPage.put`` of a decode step, in one C call (``h2ochat_stage``): each (sequence, head)'s victim
    copied from its policy column into the next staging column, counted (a row left out of the step: an
    empty entry, not counted).
    For slots in host memory (floats, or codes with their ``SCALE_TENSORS``, copied as they are); ``of``
    says whether it takes a layer's columns."""

    def __init__(self, kernels: Kernels, policy: dict[str, torch.Tensor], staging: dict[str, torch.Tensor],
                 count: torch.Tensor):
        names = ("keys", "values", "token_index", "positions", *_extras(staging))
        self.kernels, self.count, self.page = kernels, count, staging["token_index"].shape[-1]
        self.extras = len(names) - 4
        self.sources = strided(kernels, [policy[name] for name in names])
        self.targets = strided(kernels, [staging[name] for name in names])
        self._views = (policy, staging)  # (what the pointers point into, held while they are)
        keys, values = staging["keys"], staging["values"]
        self.sizes = (keys.shape[-1], keys.element_size(), values.shape[-1], values.element_size())

    @classmethod
    def of(cls, policy: dict[str, torch.Tensor], staging: dict[str, torch.Tensor],
           count: torch.Tensor) -> "Stager | None":
        kernels = _loaded()[0]
        extras = _extras(staging)
        views = [part[name] for part in (policy, staging) for name in ("keys", "values", "token_index", "positions")]
        if (kernels is None or not host_rows(count) or count.dtype != torch.long
                or any(t.device.type != "cpu" for t in views) or any(t.stride(-1) != 1 for t in views if t.dim() == 4)
                or any(t.dtype != torch.long for t in views if t.dim() == 3)
                or policy["keys"].dtype != staging["keys"].dtype or policy["values"].dtype != staging["values"].dtype
                or any(name not in policy or part[name].dtype != torch.float32 or part[name].device.type != "cpu"
                       for name in extras for part in (policy, staging) if name in part)):
            return None
        return cls(kernels, policy, staging, count)

    def __call__(self, slot: torch.Tensor, active: torch.Tensor | None = None) -> bool:
        """The victims at policy columns ``slot`` [B, H] into the staging page; ``active`` [B] bool (None:
        every row): a row left out writes an empty entry (token index -1) and does not count it."""
        if (slot.dtype != torch.long or slot.device.type != "cpu" or torch.compiler.is_compiling()
                or (active is not None and (active.device.type != "cpu" or active.dtype != torch.bool))):
            return False
        slot = slot.contiguous()
        active = None if active is None else active.contiguous()
        batch, heads = slot.shape
        self.kernels.stage(batch, heads, self.page, slot.data_ptr(), self.count.data_ptr(), self.sources, self.targets,
                           *self.sizes, None if active is None else active.data_ptr(), self.extras)
        return True

