"""Host buffers whose bytes follow what they hold (``h2ochat.host_buffers``, issue 34): the growing stores'
large buffers are memory of their own, given back at once when freed, and a row emptied to zeros gives its
pages back, so a server's RSS follows what its cold stores and parked conversations hold."""

from __future__ import annotations

import mmap
import platform
import subprocess
import sys

import pytest
import torch

from h2ochat.host_buffers import MAPPED_BYTES, fill_empty, lengthened, resident_bytes, store_buffer
from h2ochat.recall.layout import GROWTH_MARGIN, ROOM, narrowed, widened


def _rss() -> int:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) * 1024


_FREED = """
import sys, torch
from h2ochat.host_buffers import store_buffer
def rss():
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) * 1024
size = 16 << 20
torch.empty(30 << 20, dtype=torch.uint8).fill_(0)  # glibc's mmap threshold rises to this block's size
make = store_buffer if sys.argv[1] == "store_buffer" else torch.empty
buffer = make((size // 2,), dtype=torch.bfloat16)
buffer.fill_(1)  # (touched: resident)
held = rss()
del buffer
print(held - rss())
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the heap's behaviour is glibc's")
def test_a_freed_store_buffer_gives_its_pages_back_where_the_heap_keeps_them():
    """In a fresh process (the heap's mmap threshold is process-wide state), after a larger block was freed:
    a plain 16 MiB ``torch.empty`` comes from the heap and its pages stay resident when freed, the
    reference case; a ``store_buffer`` of the same size gives them back at once."""
    def returned(make: str) -> int:
        run = subprocess.run([sys.executable, "-c", _FREED, make], capture_output=True, text=True, check=True)
        return int(run.stdout.split()[-1])

    size = 16 << 20
    assert returned("torch.empty") < size * 0.1
    assert returned("store_buffer") >= size * 0.9


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


@pytest.mark.parametrize("fill", [0, -1])
def test_a_store_with_room_grows_in_place_as_a_copy_would(seed, fill):
    """``widened(room=True)`` against the copying growth, over many page-sized growths of a store whose rows
    hold different lengths: the same slots and the same fill past them, and no copy while the mapping's room
    lasts; past it, one copy into a mapping with room again."""
    generator = torch.Generator().manual_seed(seed)
    start = MAPPED_BYTES // (2 * 3 * 4 * 4) + 1  # (a mapping from the start)
    rows_held = [start, start // 2] if fill == 0 else None
    with_room = torch.full((2, 3, start + 1, 4), float(fill))
    with_room[:, :, :start] = torch.randn(2, 3, start, 4, generator=generator)
    if fill == 0:
        with_room[1, :, start // 2: start] = 0
    copied = with_room.clone()
    addresses, needed = [], start
    for _ in range(60):
        needed += 8 * 8
        with_room = widened(with_room, needed, fill, spill=True, page=8, rows_held=rows_held, room=True)
        copied = widened(copied, needed, fill, spill=True, page=8, rows_held=rows_held)
        assert with_room.shape == copied.shape and torch.equal(with_room, copied)
        addresses.append(with_room.data_ptr())
    assert with_room.shape[2] - 1 > ROOM * start  # (outgrew its first room: copied once, into more room)
    assert 2 <= len(set(addresses)) <= 3 and addresses[0] == addresses[1]
    assert lengthened(copied, copied.shape[2] + 8) is None  # (a buffer without room is copied as before)


@pytest.mark.parametrize("ring", [None, 12])
def test_appends_of_rows_that_evicted_nothing_write_nothing_new(seed, ring):
    """``Writes`` against a slow loop that writes only the entries that store something: every slot, the spill
    slot too, holds what the loop's store holds. A store that never wraps has its write-backs at each row's
    next free slot (so a growing store never writes its spill slot), a ring at its spill slot."""
    from h2ochat.recall.layout import Writes

    generator = torch.Generator().manual_seed(seed)
    batch, heads, slots, entries = 3, 2, 12, 4
    buffer = torch.randn(batch, heads, slots + 1, 5, generator=generator)  # (slots and the spill slot)
    count = torch.tensor([[0, 3], [6, 8], [2, 0]])
    expected, stored = buffer.clone(), count.clone()
    for _ in range(3):
        valid = torch.rand(batch, heads, entries, generator=generator) < 0.4
        valid[0] = False  # (a row that evicted nothing)
        new = torch.randn(batch, heads, entries, 5, generator=generator)
        writes = Writes.plan(valid, stored, ring, spill=slots)
        writes.write(buffer, new)
        for b in range(batch):
            for h in range(heads):
                for e in range(entries):
                    if valid[b, h, e]:
                        slot = int(count[b, h])
                        expected[b, h, slot % ring if ring else slot] = new[b, h, e]
                        count[b, h] += 1
        stored = stored + valid.sum(dim=-1)
        assert torch.equal(buffer, expected)
    assert torch.equal(stored, count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a mapping's unwritten pages cost nothing: Linux")
def test_a_store_s_room_costs_no_memory_and_its_rows_give_pages_back():
    """The room past a store's slots is address space only; emptying a row of a store with room (each head's
    slots one block, the row no longer contiguous) gives the pages back head by head."""
    store = store_buffer((2, 3, 40_000, 64), torch.bfloat16, room=4 * 40_000)
    assert not store.is_contiguous() and store.stride()[1] == 4 * 40_000 * 64
    assert resident_bytes(store) == 0
    store.fill_(1)
    written = 2 * 3 * 40_000 * 64 * 2
    assert written <= resident_bytes(store) <= written + 2 * 3 * mmap.PAGESIZE
    fill_empty(store[1], 0)
    assert resident_bytes(store) <= written // 2 + 2 * 3 * 2 * mmap.PAGESIZE  # (measured before a read maps zeros)
    assert bool((store[1] == 0).all()) and bool((store[0] == 1).all())


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


def _append_tokens(store, rows_tokens: list[int]) -> None:
    from h2ochat.recall.synthetic import append_rows

    append_rows(store, rows_tokens, torch.Generator().manual_seed(0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a new mapping's pages cost nothing until written: Linux")
def test_a_batch_stores_rows_are_resident_only_as_far_as_each_row_reaches():
    """Issue 34: cold stores sized by each row's own length. One row of four holds 20,000 tokens, the others
    200: the store's capacity follows the long row, but its growth copies each row only as far as the row
    reaches into a buffer that reads as zeros, so the short rows' pages past their tokens are never written
    and cost nothing. Before, every growth wrote every row's whole length (~ the store's capacity). Measured
    page by page on the store's own buffers (``mincore``), not by the process's RSS, which moved by several
    MB from run to run with the allocator's state (a fresh clone's CI once measured 35 MB against 24)."""
    from h2ochat.host_buffers import resident_bytes
    from h2ochat.recall.cold_store import ColdStore

    store = ColdStore(4, 3, 64, 64, 8, torch.bfloat16, cold_dtype="int8-values")
    rows = [20_000, 200, 200, 200]
    _append_tokens(store, rows)
    names = store._buffers()
    in_memory = sum(resident_bytes(getattr(store, name)) for name in names)
    assert store.capacity >= 20_000 and store.count.tolist() == [[n] * 3 for n in rows]
    held = sum(rows) * 3 * (64 * 2 + 64 + 4)  # each token and head: bf16 key, int8 value and its scale
    bookkeeping = 4 * 3 * (store.capacity + 1) * 12  # (token indices and positions are -1 when empty: written whole)
    assert store.written_nbytes() == held + bookkeeping  # (what /metrics says is in memory)
    assert store.nbytes() > 3.5 * held  # (the capacity: four rows of the long row's length)
    edges = len(rows) * 3 * len(names) * 2 * mmap.PAGESIZE  # (a row's first and last page are shared with its neighbours)
    assert held + bookkeeping - edges <= in_memory <= held + bookkeeping + edges  # (with every row written whole: ~50 MB)
    before = _rss()
    for head in (*store.keys.flatten(0, 1).unbind(0), *store.values.flatten(0, 1).unbind(0)):
        int(head.view(torch.uint8).max())  # a read of every slot (head by head: each one block, read in place):
    assert _rss() - before < (4 << 20)  # unwritten pages read the system's zero page (35 MB were they memory)
    assert bool((store.keys[2, :, 200:store.capacity] == 0).all())


def test_a_short_row_of_a_long_batch_grows_as_usual():
    from h2ochat.recall.cold_store import ColdStore

    store = ColdStore(4, 3, 64, 64, 8, torch.bfloat16, cold_dtype="int8-values")
    _append_tokens(store, [20_000, 200, 200, 200])
    kept = store.keys[0, :, :20_000].clone()
    _append_tokens(store, [0, 500, 0, 0])
    assert torch.equal(store.keys[0, :, :20_000], kept) and store.count[1].tolist() == [700] * 3
    assert bool((store.keys[2, :, 200:store.capacity] == 0).all())  # (past its tokens, up to the spill slot)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a given-back page costs nothing: Linux")
def test_a_row_imported_into_a_long_batch_gives_back_the_pages_past_its_tokens():
    """A server imports a short conversation into a row a long one held: past the short row's tokens
    ``import_row`` empties each head's tail by giving its pages back, not by writing zeros over them."""
    from h2ochat.recall.cold_store import ColdStore
    from h2ochat_kernels.cpu.decode_choice import PageMeans
    from h2ochat.recall.tier_rows import RecallRowMoves

    store = ColdStore(2, 3, 64, 64, 8, torch.bfloat16, cold_dtype="int8-values")
    _append_tokens(store, [20_000, 20_000])

    class Tier(RecallRowMoves):  # (the row moves over this store alone)
        cold, digest, staging = store, store, None
        page_means = PageMeans(2, 3, 64, used=True)  # (the rest's: forgotten with the row)

        def state_tensors(self):
            return {f"cold_{name}": tensor for name, tensor in store.state_tensors().items()}

        def empty_value(self, name):
            return -1 if name in ("cold_token_index", "cold_encoded", "cold_positions") else 0

        def _digest_state_written(self):
            pass

    tier = Tier()
    exported = tier.export_row(0)
    assert exported["cold_keys"].shape[1] == 20_000  # (cut to the row's tokens)
    short = {name: tensor[:, :300] if tensor.dim() >= 2 and tensor.shape[1] == 20_000 else tensor
             for name, tensor in exported.items()}
    short["cold_count"] = torch.full((3,), 300)
    before = _rss()
    tier.import_row(1, short)
    assert before - _rss() >= 0.9 * 19_700 * 3 * (64 * 2 + 64 + 4)  # (keys, values and scales past 300 tokens)
    assert torch.equal(store.keys[1, :, :300], store.keys[0, :, :300]) and bool((store.keys[1, :, 300:] == 0).all())
    assert bool((store.token_index[1, :, 300:] == -1).all())
