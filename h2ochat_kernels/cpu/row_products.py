"""A decode step's products (one to ``MAX_ROWS`` rows) on a plain bf16 weight, read at memory speed.

A decode step multiplies a row or two by every weight, so its time is the time it takes to read the
weights. ``csrc/rows_avx512bf16.c`` reads each weight once, as one sequential stream per thread, and sums in
fp32 with AVX512-BF16. Up to ``MAX_ROWS`` rows it beats oneDNN's packed product; past a few rows the product
stops being a read of the weights and oneDNN's blocking wins (``benchmarks/packed_linears.py``; figures in
``benchmarks/results_packed_linears_*.json``).

The variant is the ``rows`` module's ``avx512bf16`` (``routes.cpu_route("rows")``). Where it does not run (no
``avx512_bf16`` in the CPU's flags, an install without a C compiler, ``H2OCHAT_CPU_KERNELS=none``, its first
product disagreeing with torch's), ``available()`` says no and ``why_not()`` says why: the caller keeps
oneDNN's packed product, which rounds the same fp32 sums to bf16 (the sums in another order).
"""

from __future__ import annotations

import torch

from . import routes

MAX_ROWS = 3  # up to here the kernel beats oneDNN (the module's docstring)


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


def _checked(library):
    function = library.h2ochat_rows_bf16
    return function if _agrees_with_torch(function) else None


def _loaded() -> tuple[object | None, str]:
    """(the bound kernel, "") or (None, why it is not used)."""
    return routes.cpu_checked("rows", _checked)


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
