"""A decode step's products (one to ``MAX_ROWS`` rows) on a plain bf16 weight, read at memory speed.

A decode step multiplies a row or two by every weight, so its time is the time it takes to read the
weights. ``row_kernel.c`` reads each weight once, as one sequential stream per thread, and sums in fp32
with AVX512-BF16. Measured on this project's 2-core AMD EPYC (SmolLM2-135M's 211 linears through their
modules, one thread, CPU ms a pass; ``benchmarks/packed_linears.py``,
``benchmarks/results_packed_linears_s52_row_kernel.json``): 15.4 at one row against 21.7 for oneDNN's
packed product, 15.6 against 24.3 at two, 17.7 against 20.6 at three, then slower: 22.0 against 20.4 at
four, 30.8 against 24.1 at eight (past a few rows the product stops being a read of the weights, and
oneDNN's blocking wins). So the kernel takes up to ``MAX_ROWS`` rows.

The kernel is C, built once per machine with the system's C compiler into the user's cache folder
and called through ctypes (``native_build``, which builds the recall step's kernels too). Where it cannot run (no
``avx512_bf16`` in the CPU's flags, no compiler, a build that fails, its first product disagreeing
with torch's, or ``H2OCHAT_ROW_KERNEL=0``), ``available()`` says no and ``why_not()`` says why: the
caller keeps oneDNN's packed product.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from ..native_build import ENVIRONMENT_SWITCH, checked, signed
# (module names the tests replace: a CPU without the flag, no compiler)
from ..native_build import compiler as _compiler
from ..native_build import cpu_has_avx512_bf16 as _cpu_has_avx512_bf16

MAX_ROWS = 3  # up to here the kernel beats oneDNN (measured above)
SOURCE = Path(__file__).with_name("row_kernel.c")


def _bind(library: Path):
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    return signed(library, "h2ochat_rows_bf16", [pointer, size, size, pointer, size, size, pointer, pointer, size,
                                                 ctypes.c_int])


def _agrees_with_torch(function) -> bool:
    """One product of five rows (a group of four and one more), odd sizes and a bias, on two threads,
    against torch's fp32 product: a miscompiled or misloaded kernel is never used."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 99, generator=generator).to(torch.bfloat16)
    weight = torch.randn(131, 99, generator=generator).to(torch.bfloat16)
    bias = torch.randn(131, generator=generator).to(torch.bfloat16)
    out = torch.empty(5, 131, dtype=torch.bfloat16)
    function(x.data_ptr(), 5, x.stride(0), weight.data_ptr(), 131, 99, bias.data_ptr(), out.data_ptr(),
             out.stride(0), 2)
    expected = (x.float() @ weight.float().T + bias.float()).to(torch.bfloat16).float()
    return torch.allclose(out.float(), expected, rtol=2 ** -7, atol=1e-2)


@functools.cache
def _loaded() -> tuple[object | None, str]:
    """(the bound kernel, "") or (None, why it is not used)."""
    if os.environ.get(ENVIRONMENT_SWITCH, "1") == "0":
        return None, f"{ENVIRONMENT_SWITCH}=0"
    if not _cpu_has_avx512_bf16():
        return None, "the CPU has no avx512_bf16"
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (cc or gcc) on PATH"
    return checked("row kernel", SOURCE, compiler, _bind, _agrees_with_torch)


def available() -> bool:
    return _loaded()[0] is not None


def why_not() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    return _loaded()[1]


def fits(x: torch.Tensor) -> bool:
    """Whether ``product`` takes ``x`` (on the CPU, as the weight is): bf16, at most ``MAX_ROWS`` rows."""
    return x.dtype == torch.bfloat16 and x.numel() <= MAX_ROWS * x.shape[-1]


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` for an ``x`` that ``fits`` (bf16 weight and bias,
    contiguous): the same values to bf16 rounding (the fp32 sums are taken in another order). Lean on
    purpose: it runs for every linear of every decode step (~4 us here besides the kernel)."""
    function = _loaded()[0]
    out_features, in_features = weight.shape
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty((*x.shape[:-1], out_features), dtype=torch.bfloat16)
    rows = x.numel() // in_features
    if rows:
        function(x.data_ptr(), rows, in_features, weight.data_ptr(), out_features, in_features,
                 None if bias is None else bias.data_ptr(), out.data_ptr(), out_features, torch.get_num_threads())
    return out
