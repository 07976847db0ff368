"""The zero-copy cold tier on a real GPU (``benchmarks/gpu_check.py`` runs this file with
``TRITON_INTERPRET=0 H2OCHAT_TEST_DEVICE=cuda``; skipped elsewhere): the row kernels write and read a
pinned host buffer from the GPU exactly as torch's scatter and gather would, and a cold store on the
zero-copy route holds and returns what the copying route does."""

from __future__ import annotations

import functools
import os

import pytest
import torch

ON_GPU = (os.environ.get("H2OCHAT_TEST_DEVICE") == "cuda" and os.environ.get("TRITON_INTERPRET", "0") == "0"
          and torch.cuda.is_available())
pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device, H2OCHAT_TEST_DEVICE=cuda, TRITON_INTERPRET=0")


def test_the_probe_finds_zero_copy():
    from h2ochat_kernels.triton_rows import zero_copy_works

    assert zero_copy_works(torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int64, torch.int8])
def test_rows_move_between_the_gpu_and_pinned_memory(seed, dtype):
    from h2ochat_kernels.triton_rows import gather_rows, scatter_rows_

    g = torch.Generator().manual_seed(seed)
    buffer = (torch.randn(2, 3, 33, 64, generator=g) * 10).to(dtype).pin_memory()
    want = buffer.clone()
    index = torch.randperm(32, generator=g)[:5].expand(2, 3, 5).contiguous()
    rows = (torch.randn(2, 3, 5, 64, generator=g) * 10).to(dtype)
    want.scatter_(2, index.unsqueeze(-1).expand(2, 3, 5, 64), rows)
    scatter_rows_(buffer, index.cuda(), rows.cuda())
    torch.cuda.synchronize()
    assert torch.equal(buffer, want)
    back = gather_rows(buffer, index.cuda())
    assert back.is_cuda and torch.equal(back.cpu(), rows)


@pytest.mark.parametrize("cold_dtype", ["same", "int8"])
def test_a_zero_copy_store_equals_the_copying_store(seed, cold_dtype):
    from h2ochat.recall.cold_store import ColdStore

    g = torch.Generator(device="cuda").manual_seed(seed)
    make = functools.partial(ColdStore, 2, 3, 64, 64, 4, torch.float16, cold_dtype=cold_dtype, pin=True,
                             device="cuda", initial_pages=1)
    copying, zero = make(zero_copy=False), make(zero_copy=True)
    assert zero.zero_copy and zero.count.is_cuda
    for step in range(9):
        keys = torch.randn(2, 3, 2, 64, device="cuda", generator=g, dtype=torch.float16)
        valid = torch.rand(2, 3, 2, device="cuda", generator=g) < 0.7
        index = (torch.arange(2, device="cuda") + 2 * step).expand(2, 3, 2).masked_fill(~valid, -1)
        for store in (copying, zero):
            store.append(keys, keys, index, index.clamp(min=0))
    torch.cuda.synchronize()
    for name in copying._buffers():
        assert torch.equal(getattr(copying, name)[:, :, :copying.capacity], getattr(zero, name)[:, :, :zero.capacity])
    wanted = torch.randint(-1, 4, (2, 3, 2), device="cuda", generator=g)
    for a, b in zip(copying.pages(wanted.cpu()), zero.pages(wanted)):
        assert torch.equal(a.cuda(), b)
