"""Host buffers whose bytes follow what they hold (``h2ochat.host_buffers``, issue 34): the growing stores'
large buffers are memory of their own, given back at once when freed, and a row emptied to zeros gives its
pages back, so a server's RSS follows what its cold stores and parked conversations hold."""

from __future__ import annotations

import sys

import pytest
import torch

from h2ochat.host_buffers import MAPPED_BYTES, fill_empty, store_buffer
from h2ochat.recall.layout import GROWTH_MARGIN, narrowed, widened


def _rss() -> int:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_freed_store_buffer_gives_its_pages_back():
    size = 16 << 20
    # glibc raises its mmap threshold to the largest mapped block freed so far: after this one, a plain
    # 16 MiB torch.empty comes from the heap and its pages stay resident when freed (checked by hand in a
    # fresh process; not asserted here, as another test may have fixed the threshold: bench_memory)
    torch.empty(30 << 20, dtype=torch.uint8).fill_(0)
    before = _rss()
    buffer = store_buffer((size // 2,), torch.bfloat16)
    buffer.fill_(1)  # (touched: resident)
    held = _rss()
    del buffer
    after = _rss()
    assert held - before >= size * 0.9
    assert held - after >= size * 0.9  # returned at once, not kept in the allocator's heap


def test_store_buffers_hold_what_is_written_at_every_size():
    for shape in [(2, 3, 5, 4), (4, 3, MAPPED_BYTES // 24 + 7, 2)]:  # on the heap, then a mapping of its own
        buffer = store_buffer(shape, torch.float32)
        assert buffer.shape == shape and buffer.dtype == torch.float32 and buffer.is_contiguous()
        values = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        buffer.copy_(values)
        assert torch.equal(buffer, values)


def test_a_store_widened_and_narrowed_keeps_its_slots_and_spill():
    old = torch.arange(2 * 3 * (5 + 1) * 4, dtype=torch.float32).view(2, 3, 6, 4)  # 5 slots and the spill slot
    grown = widened(old, 40_000, -1.0, spill=True, page=8)  # large enough to be mapped
    assert 40_000 <= grown.shape[2] - 1 <= 40_000 * (1 + 1 / GROWTH_MARGIN) + 8  # (whole pages and the margin)
    assert torch.equal(grown[:, :, :5], old[:, :, :5]) and bool((grown[:, :, 5:] == -1).all())
    cut = narrowed(grown, 8)
    assert cut.shape == (2, 3, 9, 4)
    assert torch.equal(cut[:, :, :5], old[:, :, :5]) and bool((cut[:, :, 5:] == -1).all())


@pytest.mark.parametrize("needed", [10, 300, 4_000, 20_000])
def test_a_grown_cold_tier_stays_under_the_evicted_tokens_bytes_at_bf16(needed):
    """Issue 34's bound with the growth margin, at SmolLM2's head width: the default cold format (bf16 keys,
    int8 values) and the selector's 4-bit token codes reserved for ``needed`` tokens hold no more than those
    tokens' keys and values at bf16 (256 bytes a token and head), past one partly filled page and the spill."""
    from h2ochat.recall.cold_store import ColdStore
    from h2ochat.recall.digests import KeyCodes

    page, dim = 8, 64
    store = ColdStore(1, 1, dim, dim, page, torch.bfloat16, cold_dtype="int8-values")
    codes = KeyCodes(1, 1, dim, page, 4, rotate=True)
    store.reserve(needed)
    codes.reserve(needed)
    assert store.capacity >= needed and codes.capacity >= needed
    per_token = 2 * dim + (dim + 4) + 12 + (dim // 2 + 4)  # 244: key, value codes and scale, bookkeeping, codes
    assert store.nbytes() + codes.nbytes() <= needed * 2 * dim * 2 + (page + 1) * per_token


@pytest.mark.parametrize("make", [store_buffer, torch.empty])
def test_emptying_a_row_to_zero_gives_its_pages_back_and_reads_as_written(make):
    rows, row_floats = 3, (24 << 20) // 4 + 3  # (odd: the middle row starts and ends inside a page)
    buffer = make((rows, row_floats), dtype=torch.float32)
    buffer.fill_(1.5)
    held = _rss()
    fill_empty(buffer[1], 0)
    after = _rss()
    assert bool((buffer[1] == 0).all()) and bool((buffer[0] == 1.5).all()) and bool((buffer[2] == 1.5).all())
    if sys.platform.startswith("linux"):
        assert held - after >= (24 << 20) * 0.9
    fill_empty(buffer[2], -1)  # (not zero: written)
    assert bool((buffer[2] == -1).all()) and bool((buffer[0] == 1.5).all())
    buffer[1, :10] = 2.0  # (a given-back page is written again as usual)
    assert bool((buffer[1, :10] == 2).all()) and bool((buffer[1, 10:] == 0).all())
