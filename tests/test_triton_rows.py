"""The row scatter and gather kernels (the cold tier's zero-copy appends and page gathers) against
torch's scatter_ and gather, under the interpreter on tiny shapes."""

from __future__ import annotations

import pytest
import torch
from conftest import triton_interpreter_ready

pytestmark = pytest.mark.skipif(not triton_interpreter_ready(),
                                reason="needs TRITON_INTERPRET=1 before triton's import")

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.int64, torch.bool]


def _random(g, shape, dtype):
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def _expand(index, tail):
    """index [B, H, N] as torch's scatter_/gather want it for a [B, H, S, *tail] tensor."""
    return index.view(*index.shape, *([1] * len(tail))).expand(*index.shape, *tail)


def _distinct_slots(g, batch, heads, slots, count):
    """[B, H, count] slot numbers, distinct within each (b, h) (the scatter has one winner only for
    the spill slot, which the spill test covers)."""
    return torch.stack([torch.randperm(slots, generator=g)[:count] for _ in range(batch * heads)]).view(
        batch, heads, count)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tail", [(), (5,)])
def test_scatter_then_gather_match_torch(seed, dtype, tail):
    from h2ochat_kernels.triton_rows import gather_rows, scatter_rows_

    g = torch.Generator().manual_seed(seed)
    batch, heads, slots = 2, 3, 7
    buffer = _random(g, (batch, heads, slots, *tail), dtype)
    for count in (1, 4):
        index = _distinct_slots(g, batch, heads, slots, count)
        rows = _random(g, (batch, heads, count, *tail), dtype)
        want = buffer.clone().scatter_(2, _expand(index, tail), rows)
        assert scatter_rows_(buffer, index, rows) is buffer
        assert torch.equal(buffer, want)
    for count in (1, 6):
        index = torch.randint(0, slots, (batch, heads, count), generator=g)  # repeats are fine to read
        got = gather_rows(buffer, index)
        assert got.dtype == dtype and torch.equal(got, torch.gather(buffer, 2, _expand(index, tail)))


@pytest.mark.parametrize("tail", [(), (3,)])
def test_non_contiguous_buffers_are_addressed_by_their_strides(seed, tail):
    from h2ochat_kernels.triton_rows import gather_rows, scatter_rows_

    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(2, 3, 9, *tail, generator=g)
    for buffer, outside in [(whole[:, :, 2:8], [slice(0, 2), slice(8, 9)]),  # a slice along the slots
                            (whole.transpose(0, 1), [])]:  # heads before batch in memory
        before = whole.clone()
        batch, heads, slots = buffer.shape[:3]
        index = _distinct_slots(g, batch, heads, slots, 3)
        rows = torch.randn(batch, heads, 3, *tail, generator=g)
        want = buffer.clone().scatter_(2, _expand(index, tail), rows)
        scatter_rows_(buffer, index, rows)
        assert torch.equal(buffer, want)
        for part in outside:  # the slots around the slice are not touched
            assert torch.equal(whole[:, :, part], before[:, :, part])
        assert torch.equal(gather_rows(buffer, index), rows)


def test_gather_writes_into_a_given_out(seed):
    from h2ochat_kernels.triton_rows import gather_rows

    g = torch.Generator().manual_seed(seed)
    buffer = torch.randn(1, 2, 6, 4, generator=g)
    index = torch.randint(0, 6, (1, 2, 3), generator=g)
    out = torch.empty(1, 2, 3, 4)
    assert gather_rows(buffer, index, out=out) is out
    assert torch.equal(out, torch.gather(buffer, 2, _expand(index, (4,))))
    with pytest.raises(ValueError, match="out"):
        gather_rows(buffer, index, out=torch.empty(1, 2, 3, 5))


def test_rows_sent_to_the_spill_slot_leave_every_other_slot_as_torch_would(seed):
    from h2ochat_kernels.triton_rows import scatter_rows_

    g = torch.Generator().manual_seed(seed)
    batch, heads, slots, dim = 2, 2, 6, 3
    spill = slots - 1
    buffer = torch.randn(batch, heads, slots, dim, generator=g)
    index = torch.full((batch, heads, 4), spill)
    index[0, 0, 1] = 2  # one real append among spilled rows
    index[1, 1, :2] = torch.tensor([0, 3])
    rows = torch.randn(batch, heads, 4, dim, generator=g)
    want = buffer.clone().scatter_(2, _expand(index, (dim,)), rows)
    scatter_rows_(buffer, index, rows)
    assert torch.equal(buffer[:, :, :spill], want[:, :, :spill])
    # the spill slot holds one of the rows sent to it (any winner)
    for b in range(batch):
        for h in range(heads):
            sent = rows[b, h][index[b, h] == spill]
            assert (sent == buffer[b, h, spill]).all(dim=-1).any()


def test_zero_copy_works_under_the_interpreter():
    from h2ochat_kernels.triton_rows import zero_copy_works

    assert zero_copy_works("cpu") is True
    assert zero_copy_works(torch.device("cpu")) is True


def test_a_non_contiguous_tail_is_a_clear_error():
    from h2ochat_kernels.triton_rows import gather_rows, scatter_rows_

    buffer = torch.zeros(1, 2, 4, 3).transpose(2, 3)  # [1, 2, 3, 4] with tail stride 3
    index = torch.zeros(1, 2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="tail .* must be contiguous"):
        gather_rows(buffer, index)
    with pytest.raises(ValueError, match="tail .* must be contiguous"):
        scatter_rows_(buffer, index, torch.zeros(1, 2, 1, 4))
