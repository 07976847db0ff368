"""The row kernel (``h2ochat_kernels.cpu.row_products``), on every variant this CPU runs (``cpu_routes``): one to eight rows (it is used for up to three) times a
plain bf16 weight equal torch's fp32 product rounded to bf16 (to one rounding step: the fp32 sums are
taken in another order),
for odd sizes, biases, strided and batched inputs and any thread count; and where it cannot run, it
says why and is not used."""

from __future__ import annotations

import pytest
import torch

from cpu_routes import rows_route, torch_route  # noqa: F401 (fixtures)

from h2ochat_kernels.cpu import routes, row_products, variants


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


@pytest.mark.usefixtures("rows_route")
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


@pytest.mark.usefixtures("rows_route")
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


@pytest.mark.usefixtures("rows_route")
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


def test_the_switch_turns_it_off(torch_route):
    torch_route()
    assert not row_products.available() and row_products.why_not() == "H2OCHAT_CPU_KERNELS=none"


def test_a_cpu_without_avx512_bf16_does_not_use_it(monkeypatch):
    """A CPU lacking the variant's flags runs oneDNN's product, and the reason names what it lacks."""
    monkeypatch.setattr(routes, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    routes._cpu_route.cache_clear()
    try:
        assert not row_products.available() and "avx512_bf16" in row_products.why_not()
        assert "\n" not in row_products.why_not()
    finally:
        monkeypatch.undo()
        routes._cpu_route.cache_clear()


def test_an_install_that_built_nothing_says_why_once(monkeypatch, capsys):
    """No C compiler at install (nothing built): the torch route, and one line on standard error saying so."""
    monkeypatch.setattr(routes.binding, "built", lambda variant: None)
    monkeypatch.setattr(routes, "_said", set())
    routes._cpu_route.cache_clear()
    try:
        for _ in range(3):
            assert routes.cpu_route("recall")[0] is None
        assert not row_products.available() or not routes.cpu_runs(variants.of("rows")[0])
        lines = [line for line in capsys.readouterr().err.splitlines() if "recall kernels" in line]
        assert len(lines) == (1 if any(routes.cpu_runs(v) for v in variants.of("recall")) else 0)
        assert all("torch route" in line and "same results" in line for line in lines)
    finally:
        monkeypatch.undo()
        routes._cpu_route.cache_clear()
