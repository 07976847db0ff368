"""Host buffers for the stores that grow with the text (the cold store, the token codes beside it).

A store grows a page at a time: each growth allocates a buffer one page longer and frees the old one.
Inside glibc's heap the freed buffers leave holes that no later, longer buffer fits, so a served chat
load's RSS grew far past what its stores held (8 chats x 4 turns, ``benchmarks/serve_recall_load.py``:
RSS +750 MB while the cold stores grew by 204 MB). A buffer of ``MAPPED_BYTES`` or more is therefore an
anonymous memory mapping of its own: freed, it goes back to the system at once, and the process's RSS
follows the stores' bytes. Smaller buffers (a short text's store, every temporary) stay on the heap.
"""

from __future__ import annotations

import mmap

import torch

MAPPED_BYTES = 256 << 10  # (a mapping costs a system call and its page faults: worth it from a few pages of a store up)


def store_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """An uninitialised buffer of ``shape``: in host memory of its own when it is a large CPU buffer, else
    ``torch.empty``. The tensor keeps its mapping alive; the mapping is unmapped when the tensor is freed."""
    device = torch.device(device or "cpu")
    count = 1
    for size in shape:
        count *= size
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < MAPPED_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)
