"""Host buffers whose bytes follow what they hold: the recall tier's stores that grow with the text, and
the rows a server empties.

A store grows page by page: each growth allocates a longer buffer and frees the old one. Inside glibc's
heap the freed buffers left holes that no later, longer buffer fits, so a served chat load's RSS grew far
past what its stores held (8 chats x 4 turns, ``benchmarks/serve_recall_load.py``: RSS +750 MB while the
cold stores grew by 204 MB). A buffer of ``MAPPED_BYTES`` or more (``store_buffer``) is therefore a
private anonymous mapping of its own: freed, it goes back to the system at once.

A server parks a finished conversation (a copy) and empties its row, while the batch's stores keep the
longest row's length; emptying a row to zeros (``fill_empty``) hands its whole pages back to the system
(``madvise(MADV_DONTNEED)``: they read as zeros again, and cost nothing until written), so a parked
conversation is not held twice. Elsewhere (another system, pinned or device memory) both are plain torch.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys

import torch

MAPPED_BYTES = 256 << 10  # (a mapping costs a system call and its page faults: worth it from a few pages of a store up)
_DISCARD = sys.platform.startswith("linux") and hasattr(mmap, "MAP_PRIVATE")
_MADV_DONTNEED = 4  # Linux: private anonymous pages are dropped and read as zeros afterwards
_PAGE = mmap.PAGESIZE


def store_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None, *,
                 pin: bool = False, zeroed: bool = False) -> torch.Tensor:
    """A buffer of ``shape``, uninitialised unless ``zeroed``: pinned host memory when ``pin`` (a GPU's cold
    store); a mapping of its own when it is a large CPU buffer on Linux; else ``torch.empty``. The tensor keeps
    its mapping alive; the mapping is unmapped when the tensor is freed. A new mapping reads as zeros and
    costs no memory until a page is written, so ``zeroed`` writes nothing there: a store's rows become
    resident only as far as they are written (reading an unwritten page maps the system's shared zero page: no memory)."""
    device = torch.device(device or "cpu")
    count = math.prod(shape)
    if pin or device.type != "cpu" or count * dtype.itemsize < MAPPED_BYTES or not _DISCARD:
        buffer = torch.empty(shape, dtype=dtype).pin_memory() if pin else torch.empty(shape, dtype=dtype, device=device)
        return buffer.zero_() if zeroed else buffer
    mapping = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (discardable)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def fill_empty(target: torch.Tensor, value) -> None:
    """``target.fill_(value)``; a large contiguous CPU block emptied to zero gives its whole pages back to the
    system instead of writing them (the bytes past the first and last whole page are written). For the
    caches' own buffers, which are anonymous memory (torch's allocator or ``store_buffer``): a page of a
    file-backed tensor would read its file again, not zeros."""
    nbytes = target.numel() * target.element_size()
    if (value != 0 or not _DISCARD or nbytes < MAPPED_BYTES or target.device.type != "cpu" or target.is_pinned()
            or not target.is_contiguous()):
        target.fill_(value)
        return
    start = target.data_ptr()
    first, last = -(-start // _PAGE) * _PAGE, (start + nbytes) // _PAGE * _PAGE
    flat = target.reshape(-1).view(torch.uint8)
    flat[: first - start].zero_()
    flat[last - start:].zero_()
    if _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) != 0:
        flat[first - start: last - start].zero_()  # (refused: written as usual)


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the pages under ``tensor``'s storage that are in memory (Linux ``mincore``): the pages a
    store's rows have written, where its buffers are mappings of their own. Exact and private to the tensor,
    where the process's RSS moves with everything else it allocates. A read of a never-written page maps the
    system's zero page, which ``mincore`` counts (and RSS does not): measure before reading."""
    storage = tensor.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    first, last = start // _PAGE * _PAGE, -(-(start + size) // _PAGE) * _PAGE
    flags = (ctypes.c_ubyte * ((last - first) // _PAGE))()
    if _libc().mincore(ctypes.c_void_p(first), ctypes.c_size_t(last - first), flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(flag & 1 for flag in flags) * _PAGE
