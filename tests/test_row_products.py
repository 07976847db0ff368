"""The row kernel (``h2ochat.engine.row_products``): one to eight rows (it is used for up to three) times a
plain bf16 weight equal torch's fp32 product rounded to bf16 (to one rounding step: the fp32 sums are
taken in another order),
for odd sizes, biases, strided and batched inputs and any thread count; and where it cannot run, it
says why and is not used."""

from __future__ import annotations

import pytest
import torch

from h2ochat import native_build
from h2ochat.engine import row_products

needs_kernel = pytest.mark.skipif(not row_products.available(), reason=f"no row kernel: {row_products.why_not()}")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The slow obvious product: fp32 throughout, rounded to bf16 once."""
    out = x.float() @ weight.float().T
    return (out if bias is None else out + bias.float()).to(torch.bfloat16)


def assert_within_one_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal, or one bf16 step apart (where the fp32 sum sat on a rounding boundary)."""
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    step = expected.float().abs().clamp_min(1e-30) * 2 ** -7
    assert ((got.float() - expected.float()).abs() <= step + 1e-6).all()
    assert (got == expected).float().mean() > 0.9  # almost every value is exactly torch's


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("in_features, out_features", [(32, 1), (64, 65), (99, 131), (576, 192), (1000, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_product_is_torchs_for_every_row_count_and_size(rows, in_features, out_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16) if with_bias else None
    assert row_products.fits(x) == (rows <= row_products.MAX_ROWS)  # (the kernel itself takes any count)
    assert_within_one_rounding(row_products.product(x, weight, bias), reference(x, weight, bias))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_split_the_weight_rows_and_give_the_same_bits(threads):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(3, 200, generator=generator).to(torch.bfloat16)
    weight = torch.randn(1000, 200, generator=generator).to(torch.bfloat16)  # 16 blocks of 64 rows
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = row_products.product(x, weight, None)
        torch.set_num_threads(threads)
        split = row_products.product(x, weight, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(split, one)  # each output is one thread's sum, in the same order
    assert_within_one_rounding(split, reference(x, weight, None))


@needs_kernel
def test_strided_and_batched_inputs_keep_their_shape():
    generator = torch.Generator().manual_seed(8)
    wide = torch.randn(2, 3, 160, generator=generator).to(torch.bfloat16)
    x = wide[..., :96]  # rows 160 values apart
    weight = torch.randn(40, 96, generator=generator).to(torch.bfloat16)
    out = row_products.product(x, weight, None)
    assert out.shape == (2, 3, 40)
    assert_within_one_rounding(out, reference(x, weight, None))
    columns = torch.randn(96, 4, generator=generator).to(torch.bfloat16).T  # a row's values not adjacent
    assert_within_one_rounding(row_products.product(columns, weight, None), reference(columns, weight, None))
    empty = torch.empty(0, 96, dtype=torch.bfloat16)
    assert row_products.product(empty, weight, None).shape == (0, 40)


def test_what_the_kernel_takes():
    assert row_products.fits(torch.zeros(row_products.MAX_ROWS, 16, dtype=torch.bfloat16))
    assert row_products.fits(torch.zeros(1, row_products.MAX_ROWS, 16, dtype=torch.bfloat16))  # (rows of any dims)
    assert not row_products.fits(torch.zeros(row_products.MAX_ROWS + 1, 16, dtype=torch.bfloat16))
    assert not row_products.fits(torch.zeros(1, 16))  # fp32


@pytest.fixture
def fresh_load():
    """``row_products`` deciding again (its decision is cached per process), and forgetting it after."""
    row_products._loaded.cache_clear()
    yield
    row_products._loaded.cache_clear()


def test_the_switch_turns_it_off(fresh_load, monkeypatch):
    monkeypatch.setenv(row_products.ENVIRONMENT_SWITCH, "0")
    assert not row_products.available() and row_products.why_not() == "H2OCHAT_ROW_KERNEL=0"


def test_a_cpu_without_avx512_bf16_does_not_use_it(fresh_load, monkeypatch):
    monkeypatch.setattr(row_products, "_cpu_has_avx512_bf16", lambda: False)
    assert not row_products.available() and "avx512_bf16" in row_products.why_not()


def test_no_compiler_or_a_failing_build_says_why_in_one_line(fresh_load, monkeypatch, tmp_path):
    monkeypatch.setattr(row_products, "_cpu_has_avx512_bf16", lambda: True)
    monkeypatch.setattr(row_products, "_compiler", lambda: None)
    assert not row_products.available() and row_products.why_not() == "no C compiler (cc or gcc) on PATH"
    row_products._loaded.cache_clear()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # (not the cache a working build sits in)
    monkeypatch.setattr(row_products, "_compiler", lambda: "false")  # a compiler that always fails
    assert not row_products.available()
    reason = row_products.why_not()
    assert reason.startswith("the row kernel did not build: false failed") and "\n" not in reason
    assert not list(tmp_path.rglob("*.so"))  # no half-written library left for the next process


@needs_kernel
def test_the_build_is_cached_per_source_and_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = row_products._compiler()
    first = native_build.build(compiler, row_products.SOURCE)
    assert first.parent == tmp_path / "h2ochat" / "native" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert native_build.build(compiler, row_products.SOURCE) == first and first.stat().st_mtime_ns == stamp  # not built again


@needs_kernel
def test_cc_is_split_as_the_shell_would_and_a_compiler_without_openmp_builds_it_single_threaded(monkeypatch,
                                                                                            tmp_path):
    """$CC with a wrapper in front ("env gcc", as "ccache gcc"); a compiler that refuses -fopenmp (a
    script standing in for clang without libomp) still builds the kernel, without threads."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real = row_products._compiler()
    assert native_build.build(f"env {real}", row_products.SOURCE).is_file()
    no_openmp = tmp_path / "cc-without-openmp"
    no_openmp.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {real} "$@"\n')
    no_openmp.chmod(0o755)
    library = native_build.build(str(no_openmp), row_products.SOURCE)
    function = row_products._bind(library)
    assert row_products._agrees_with_torch(function)


def test_a_kernel_that_disagrees_with_torch_is_not_used(fresh_load, monkeypatch):
    if row_products._compiler() is None or not row_products._cpu_has_avx512_bf16():
        pytest.skip("no row kernel to break")
    monkeypatch.setattr(row_products, "_agrees_with_torch", lambda function: False)
    assert not row_products.available() and "disagreed" in row_products.why_not()
