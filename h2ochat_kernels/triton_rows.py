"""Row scatter and gather between a GPU and a buffer that may live in pinned host memory.

The cold tier of recall keeps evicted tokens in host memory. Under CUDA's unified virtual
addressing a pinned host tensor (``pin_memory()``, cudaHostAlloc) is addressable by kernels: Triton's
launcher asks the driver for each pointer argument's device pointer (cuPointerGetAttribute), which
succeeds for pinned memory, and the kernel then reads and writes it over the bus. So appends and page
gathers run on the step's stream with no host synchronisation. ``zero_copy_works`` checks once per
device that this holds, so a caller can fall back to ordinary copies where it does not.

A row is a slot's tail: () or (D,). Both kernels move bits: every dtype goes through the integer view
of its width (one compiled kernel per width, no float conversion, and NaN payloads, -0.0, bf16 and
bool kept exactly, also under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting, launch_guard, next_pow2

# The integer dtype each element width is moved as.
_BITS_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _rows_kernel(Buf, Idx, Src, Dst, N, D,
                 sb_b, sb_h, sb_s, si_b, si_h, si_n, sx_b, sx_h, sx_n,
                 HEADS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, SCATTER: tl.constexpr):
    """SCATTER: Buf[b, h, Idx[b, h, n]] = Src[b, h, n]; else Dst[b, h, n] = Buf[b, h, Idx[b, h, n]].
    (Src is Dst's stand-in in the other mode: the x strides are those of whichever is used.)"""
    # int64 throughout: a host buffer can hold more than 2**31 elements
    bh = tl.program_id(0).to(tl.int64)
    b = bh // HEADS
    h = bh % HEADS
    n = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_n = n < N
    slot = tl.load(Idx + b * si_b + h * si_h + n * si_n, mask=in_n, other=0).to(tl.int64)
    buf_row = Buf + b * sb_b + h * sb_h + slot * sb_s
    x_row = b * sx_b + h * sx_h + n * sx_n
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        mask = in_n[:, None] & (d[None, :] < D)
        if SCATTER:
            vals = tl.load(Src + x_row[:, None] + d[None, :], mask=mask)
            tl.store(buf_row[:, None] + d[None, :], vals, mask=mask)
        else:
            vals = tl.load(buf_row[:, None] + d[None, :], mask=mask)
            tl.store(Dst + x_row[:, None] + d[None, :], vals, mask=mask)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element width (same storage, so writes land in t)."""
    width = t.element_size()
    if width not in _BITS_OF_WIDTH:
        raise TypeError(f"rows of {t.dtype} ({width}-byte elements) are not supported")
    return t if t.dtype == _BITS_OF_WIDTH[width] else t.view(_BITS_OF_WIDTH[width])


def _tail(t: torch.Tensor, name: str) -> tuple[int, ...]:
    """The tail of a [B, H, N, *tail] tensor, checked to be () or a contiguous (D,)."""
    if t.dim() not in (3, 4):
        raise ValueError(f"{name}: expected [B, H, N] or [B, H, N, D], got shape {tuple(t.shape)}")
    if t.dim() == 4 and t.shape[3] > 1 and t.stride(3) != 1:
        raise ValueError(f"{name}: the row tail (last dim) must be contiguous (stride 1), got strides "
                         f"{t.stride()}; make it .contiguous() or keep the tail last")
    return tuple(t.shape[3:])


def _check_devices(buffer: torch.Tensor, index: torch.Tensor, other: torch.Tensor, other_name: str) -> None:
    if index.dtype != torch.int64:
        raise TypeError(f"index: expected int64 slot numbers, got {index.dtype}")
    if other.device != index.device:
        raise ValueError(f"{other_name} is on {other.device} but index is on {index.device}")
    if interpreting():
        return
    if index.device.type != "cuda":
        raise ValueError(f"index must be a CUDA tensor for a Triton launch, got {index.device}")
    if buffer.device != index.device and not (buffer.device.type == "cpu" and buffer.is_pinned()):
        raise ValueError(f"buffer must be on {index.device} or in pinned host memory, got {buffer.device}"
                         f"{' (not pinned)' if buffer.device.type == 'cpu' else ''}")


def _launch(buffer: torch.Tensor, index: torch.Tensor, x: torch.Tensor, scatter: bool) -> None:
    batch, heads, count = index.shape
    width = 1 if buffer.dim() == 3 else buffer.shape[3]
    if batch * heads * count * width == 0:
        return  # (an empty grid is not a launch Triton accepts)
    block_d = min(next_pow2(width), 256)
    # enough rows per program to fill ~2K lanes, not more rows than there are
    rows = max(1, min(next_pow2(count), 2048 // block_d))
    grid = (batch * heads, triton.cdiv(count, rows))
    # launch_guard on index: the GPU-side tensor fixes device and stream (a pinned buffer is "cpu")
    with launch_guard(index):
        _rows_kernel[grid](
            _as_bits(buffer), index, _as_bits(x), _as_bits(x), count, width,
            buffer.stride(0), buffer.stride(1), buffer.stride(2), index.stride(0), index.stride(1), index.stride(2),
            x.stride(0), x.stride(1), x.stride(2),
            HEADS=heads, ROWS=rows, BLOCK_D=block_d, SCATTER=scatter)


def scatter_rows_(buffer: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """In place ``buffer[b, h, index[b, h, e]] = rows[b, h, e]``; returns ``buffer``.

    buffer [B, H, S, *tail] (tail () or (D,), contiguous; any strides on dims 0-2), on index's device
    or in pinned host memory (written zero-copy); index [B, H, E] int64, every slot in range (rows a
    caller does not want go to a spill slot; duplicate slots leave any one of their rows); rows
    [B, H, E, *tail] of buffer's dtype on index's device. Asynchronous on a GPU, like any launch.
    """
    tail = _tail(buffer, "buffer")
    _check_devices(buffer, index, rows, "rows")
    if rows.dtype != buffer.dtype or rows.shape != (*index.shape, *tail) or index.shape[:2] != buffer.shape[:2]:
        raise ValueError(f"scatter_rows_: buffer {tuple(buffer.shape)} {buffer.dtype}, index {tuple(index.shape)}, "
                         f"rows {tuple(rows.shape)} {rows.dtype} do not fit [B, H, S, *tail], [B, H, E], "
                         f"[B, H, E, *tail] of one dtype")
    if rows.dim() == 4 and rows.stride(3) != 1:
        rows = rows.contiguous()  # a copy of a few GPU rows, cheaper than a strided tail on the bus
    _launch(buffer, index, rows, scatter=True)
    return buffer


def gather_rows(buffer: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[b, h, k] = buffer[b, h, index[b, h, k]]``: [B, H, K, *tail] on index's device.

    buffer as for ``scatter_rows_`` (pinned host memory is read zero-copy); index [B, H, K] int64,
    every slot in range; ``out``, when given, of that shape and buffer's dtype with a contiguous tail.
    """
    tail = _tail(buffer, "buffer")
    if index.shape[:2] != buffer.shape[:2]:
        raise ValueError(f"gather_rows: index {tuple(index.shape)} does not fit buffer {tuple(buffer.shape)}")
    if out is None:
        out = torch.empty(*index.shape, *tail, dtype=buffer.dtype, device=index.device)
    elif out.dtype != buffer.dtype or out.shape != (*index.shape, *tail):
        raise ValueError(f"gather_rows: out {tuple(out.shape)} {out.dtype}, expected "
                         f"{(*index.shape, *tail)} {buffer.dtype}")
    else:
        _tail(out, "out")
    _check_devices(buffer, index, out, "out")
    _launch(buffer, index, out, scatter=False)
    return out


_PROBED: dict[torch.device, bool] = {}


def zero_copy_works(device: torch.device | str) -> bool:
    """Whether these kernels can scatter into and gather from pinned host memory on ``device``.

    Probed once per CUDA device (a few rows out to a pinned tensor and back, synchronised, compared):
    any failure means False, and the caller keeps ordinary copies. Non-CUDA devices: False, except
    under the Triton interpreter, where every tensor is a CPU tensor and the kernels do run.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return interpreting()
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _PROBED:
        _PROBED[device] = _probe(device)
    return _PROBED[device]


def _probe(device: torch.device) -> bool:
    try:
        # distinct nonzero values, so a kernel that writes nothing or the wrong row is caught
        host = torch.full((2, 3, 5, 3), -1.0).pin_memory()
        index = torch.tensor([4, 0, 2]).repeat(2, 3, 1)
        rows = torch.arange(2 * 3 * 3 * 3, dtype=torch.float32).reshape(2, 3, 3, 3)
        want = torch.full((2, 3, 5, 3), -1.0).scatter_(2, index.unsqueeze(-1).expand(-1, -1, -1, 3), rows)
        index, rows_dev = index.to(device), rows.to(device)
        scatter_rows_(host, index, rows_dev)
        back = gather_rows(host, index[:, :, [2, 0]])
        torch.cuda.synchronize(device)
        return torch.equal(host, want) and torch.equal(back.cpu(), rows[:, :, [2, 0]])
    except Exception:
        return False
