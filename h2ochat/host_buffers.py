"""Host buffers whose bytes follow what they hold: the recall tier's stores that grow with the text, and
the rows a server empties.

A store grows page by page: each growth allocates a longer buffer and frees the old one. Inside glibc's
heap the freed buffers left holes that no later, longer buffer fits, so a served chat load's RSS grew far
past what its stores held (8 chats x 4 turns, ``benchmarks/serve_recall_load.py``: RSS +750 MB while the
cold stores grew by 204 MB). A buffer of ``MAPPED_BYTES`` or more (``store_buffer``) is therefore a
private anonymous mapping of its own: freed, it goes back to the system at once.

A store that grows by pages would copy itself at every growth (every ~3% of its length). Its mapping
therefore reserves room (``store_buffer(room=)``): the buffer is a view of the first slots of a longer
mapping, and ``lengthened`` gives it more slots over the same memory, copying nothing. The room past the
view is never written, so it costs address space, not memory.

A server parks a finished conversation (a copy) and empties its row, while the batch's stores keep the
longest row's length; emptying a row to zeros (``fill_empty``) hands its whole pages back to the system
(``madvise(MADV_DONTNEED)``: they read as zeros again, and cost nothing until written), so a parked
conversation is not held twice. Elsewhere (another system, pinned or device memory) both are plain torch.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

from . import libc

MAPPED_BYTES = 256 << 10  # (a mapping costs a system call and its page faults: worth it from a few pages of a store up)
_DISCARD = sys.platform.startswith("linux") and hasattr(mmap, "MAP_PRIVATE")
_MADV_DONTNEED = 4  # Linux: private anonymous pages are dropped and read as zeros afterwards
_PAGE = mmap.PAGESIZE


def store_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None, *,
                 pin: bool = False, zeroed: bool = False, room: int | None = None) -> torch.Tensor:
    """A buffer of ``shape``, uninitialised unless ``zeroed``: pinned host memory when ``pin`` (a GPU's cold
    store); a mapping of its own when it is a large CPU buffer on Linux; else ``torch.empty``. The tensor keeps
    its mapping alive; the mapping is unmapped when the tensor is freed. A new mapping reads as zeros and
    costs no memory until a page is written, so ``zeroed`` writes nothing there: a store's rows become
    resident only as far as they are written (reading an unwritten page maps the system's shared zero page: no memory).
    ``room`` (more than ``shape[2]``): a mapping is made ``room`` long in dimension 2 and the buffer is a view
    of its first ``shape[2]`` (``lengthened`` grows it in place); the system refusing that much address
    space, it is made as asked."""
    device = torch.device(device or "cpu")
    count = math.prod(shape)
    if pin or device.type != "cpu" or count * dtype.itemsize < MAPPED_BYTES or not _DISCARD:
        buffer = torch.empty(shape, dtype=dtype).pin_memory() if pin else torch.empty(shape, dtype=dtype, device=device)
        return buffer.zero_() if zeroed else buffer
    if room is not None and room > shape[2]:
        reserved = (*shape[:2], room, *shape[3:])
        try:
            whole = _mapped(reserved, dtype)
        except OSError:  # (no address space for the room: no room)
            return _mapped(shape, dtype)
        return _over(whole, shape, whole.stride())
    return _mapped(shape, dtype)


def _mapped(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    count = math.prod(shape)
    mapping = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (discardable)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)


def _over(tensor: torch.Tensor, shape, stride) -> torch.Tensor:
    """A tensor of ``shape`` and ``stride`` over ``tensor``'s memory from its start, with no autograd base
    (as ``TierPort.columns_of`` makes its views) and of the current inference mode."""
    return torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage(), 0, tuple(shape), tuple(stride))


def lengthened(tensor: torch.Tensor, size: int, dim: int = 2) -> torch.Tensor | None:
    """``tensor`` with dimension ``dim`` ``size`` long over the same memory (what it holds stays where it is;
    the new slots read what the mapping holds there: zeros, never written), where its mapping has that room
    (``store_buffer(room=)``); else None (the caller copies it into a new buffer). For a whole buffer that
    ``store_buffer`` or a growth made, not a slice: a slice's "room" would be the rest of its buffer."""
    if tensor.device.type != "cpu" or tensor.is_pinned() or tensor.storage_offset() != 0 or not _DISCARD:
        return None
    shape = list(tensor.shape)
    across = math.prod(shape[:dim]) * math.prod(shape[dim + 1:])
    room = tensor.untyped_storage().nbytes() // tensor.element_size() // max(1, across)
    reserved = [*shape[:dim], room, *shape[dim + 1:]]
    stride = [math.prod(reserved[i + 1:]) for i in range(len(reserved))]
    if size > room or any(n > 1 and s != t for n, s, t in zip(shape, tensor.stride(), stride)):
        return None
    shape[dim] = size
    return _over(tensor, shape, stride)


def fill_empty(target: torch.Tensor, value) -> None:
    """``target.fill_(value)``; a large contiguous CPU block emptied to zero gives its whole pages back to the
    system instead of writing them (the bytes past the first and last whole page are written). For the
    caches' own buffers, which are anonymous memory (torch's allocator or ``store_buffer``): a page of a
    file-backed tensor would read its file again, not zeros."""
    nbytes = target.numel() * target.element_size()
    if value == 0 and not target.is_contiguous() and target.dim() > 1 and all(
            part.is_contiguous() for part in target.unbind(0)):
        for part in target.unbind(0):  # (a row of a store with room: each head's slots are one block)
            fill_empty(part, value)
        return
    if (value != 0 or not _DISCARD or nbytes < MAPPED_BYTES or target.device.type != "cpu" or target.is_pinned()
            or not target.is_contiguous()):
        target.fill_(value)
        return
    start = target.data_ptr()
    first, last = -(-start // _PAGE) * _PAGE, (start + nbytes) // _PAGE * _PAGE
    flat = target.reshape(-1).view(torch.uint8)
    flat[: first - start].zero_()
    flat[last - start:].zero_()
    if not libc.madvise(first, last - first, _MADV_DONTNEED):
        flat[first - start: last - start].zero_()  # (refused: written as usual)


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the pages under ``tensor``'s storage that are in memory (Linux ``mincore``): the pages a
    store's rows have written, where its buffers are mappings of their own. Exact and private to the tensor,
    where the process's RSS moves with everything else it allocates. A read of a never-written page maps the
    system's zero page, which ``mincore`` counts (and RSS does not): measure before reading."""
    storage = tensor.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    first, last = start // _PAGE * _PAGE, -(-(start + size) // _PAGE) * _PAGE
    return libc.resident_pages(first, (last - first) // _PAGE, _PAGE) * _PAGE
