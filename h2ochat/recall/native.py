"""The recall step's C kernels (``recall_kernel.c``) for a CPU step over a cold store in the same memory.

A decode step of the exact selector scores every cold key against the group's few queries. The torch
reference (``h2ochat_kernels.recall_reference.page_scores``) makes fp32 copies of the keys and of the
[M, T] dots before two maxima: ~170 us a layer at 2K bf16 keys on this project's 2-core AMD EPYC, where
the same sums read straight from the bf16 keys by VDPBF16PS (products exact in fp32, summed in fp32)
are one pass over the keys. The scores are the reference's up to the order the fp32 sums are added in.

Built like the row kernel (``engine.row_products.built``: the CPU's AVX512-BF16 flag, a C compiler, once
per machine) and checked against the torch reference on first use; where it cannot run, or with
``H2OCHAT_RECALL_KERNEL=0``, ``page_best`` returns None and the caller keeps the torch reference.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from h2ochat_kernels.recall_reference import page_scores as reference_page_scores
from h2ochat_kernels.recall_reference import top_pages as kernels_top_pages

from ..engine import row_products

ENVIRONMENT_SWITCH = "H2OCHAT_RECALL_KERNEL"  # "0": the torch reference only
SOURCE = Path(__file__).with_name("recall_kernel.c")
MAX_QUERIES = 16  # a decode step's group (a prompt chunk's thousands of queries: one fp32 product is faster)


@dataclass(frozen=True)
class Kernels:
    page_best: object
    top_pages: object


def _bind(library: Path) -> Kernels:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    scoring = [pointer, size, size, size, size, pointer, size, size, size, pointer, size, size]
    return Kernels(page_best=row_products.signed(library, "h2ochat_page_best_bf16", [*scoring, pointer]),
                   top_pages=row_products.signed(library, "h2ochat_top_pages_bf16", [*scoring, size, pointer]))


def _scoring(queries, keys) -> list:
    """The arguments the scoring kernels share: queries (contiguous) and the keys' view."""
    batch, heads, count, dim = queries.shape
    return [queries.data_ptr(), batch, heads, count, dim, keys.data_ptr(), keys.stride(0), keys.stride(1),
            keys.stride(2)]


def _call_page_best(kernels: Kernels, queries, keys, valid, page) -> torch.Tensor:
    tokens, queries, valid = keys.shape[2], queries.contiguous(), valid.contiguous()
    out = torch.empty(*queries.shape[:2], tokens // page, dtype=torch.float32)
    kernels.page_best(*_scoring(queries, keys), valid.data_ptr(), tokens, page, out.data_ptr())
    return out


def _call_top_pages(kernels: Kernels, queries, keys, count, page, k) -> torch.Tensor:
    tokens, queries, count = keys.shape[2], queries.contiguous(), count.contiguous()
    k = min(k, tokens // page)
    wanted = torch.empty(*queries.shape[:2], k, dtype=torch.long)
    kernels.top_pages(*_scoring(queries, keys), count.data_ptr(), tokens, page, k, wanted.data_ptr())
    return wanted


def _agrees_with_torch(kernels: Kernels) -> bool:
    """Odd sizes (a head dim with a tail of 32, a view with gaps), some slots invalid, an empty page:
    against the torch reference, within fp32 rounding."""
    generator = torch.Generator().manual_seed(0)
    store = torch.randn(2, 3, 50, 72, generator=generator).to(torch.bfloat16)
    keys = store[:, :, :40, :67]
    queries = torch.randn(2, 3, 5, 67, generator=generator).to(torch.bfloat16)
    valid = torch.rand(2, 3, 40, generator=generator) > 0.3
    valid[:, :, 8:16] = False
    got = _call_page_best(kernels, queries, keys, valid, 8)
    expected = reference_page_scores(queries, keys, None, None, valid, 8)
    agrees = bool(torch.allclose(got, expected, rtol=1e-5, atol=1e-4)) and bool((got[:, :, 1] == float("-inf")).all())
    count = torch.tensor([[0, 1, 17], [23, 40, 39]])
    top = _call_top_pages(kernels, queries, keys, count, 8, 4)
    slots = torch.arange(40)
    scores = reference_page_scores(queries, keys, None, None, slots < count.unsqueeze(-1), 8)
    return agrees and torch.equal(top, kernels_top_pages(scores, 4))


@functools.cache
def _loaded() -> tuple[Kernels | None, str]:
    """(the bound kernels, "") or (None, why they are not used)."""
    if os.environ.get(ENVIRONMENT_SWITCH, "1") == "0":
        return None, f"{ENVIRONMENT_SWITCH}=0"
    try:
        kernels = _bind(row_products.built(SOURCE))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        return None, f"the recall kernel did not build: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    if not _agrees_with_torch(kernels):
        return None, "the recall kernel's page scores disagreed with torch's"
    return kernels, ""


def available() -> bool:
    return _loaded()[0] is not None


def why_not() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    return _loaded()[1]


def page_best(queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, page: int) -> torch.Tensor | None:
    """``recall_reference.page_scores(queries, keys, None, None, valid, page)`` (queries [B, H, M, D],
    keys [B, H, T, D] bf16 on the CPU, unit stride along D, valid [B, H, T]) from the C kernel; None
    where it does not take these (another dtype or device, many queries, no kernel): the caller's
    torch reference then."""
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
    if not (keys.dtype == queries.dtype == torch.bfloat16 and keys.device.type == "cpu"
            and queries.device.type == "cpu" and queries.shape[2] <= MAX_QUERIES and keys.stride(-1) == 1
            and keys.shape[2] % page == 0 and not torch.compiler.is_compiling()):
        return None
    return _loaded()[0]
