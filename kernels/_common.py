"""What the Triton kernel modules share: host-side launch plumbing and the small @triton.jit pieces
more than one kernel calls.

This module imports triton, so only the triton_* modules import it at their top (``dispatch`` takes
``interpreting`` from it lazily, on a Triton call): importing ``h2ochat_kernels`` never needs triton.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

# Logit given to masked keys. It equals reference._MASKED (float32 min), so a row with every key
# masked (possible only for a padding row) gets the same uniform softmax as the reference instead of
# NaN. Keys that do not exist at all (past the end of a block) get -inf and weigh exactly nothing.
MASKED = float(torch.finfo(torch.float32).min)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dot_mode(dtype: torch.dtype) -> bool:
    """Whether tl.dot may take the inputs in their own 16-bit dtype (tensor cores, fp32 accumulate).

    fp32 inputs always go through an fp32 ("ieee") dot so results match torch to ~1e-6. Under the
    interpreter bf16 values are raw uint16 until converted, so bf16 is upcast there as well.
    """
    if dtype == torch.float16:
        return True
    if dtype == torch.bfloat16:
        return not interpreting()
    return False


def check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")


def launch_guard(tensor: torch.Tensor):
    """Context for a Triton launch on ``tensor``'s data.

    Triton launches on the *current* CUDA device and that device's current torch stream, not on the
    device of the pointers it is given: with the layers of a model spread over GPUs (device_map auto)
    a layer on cuda:1 would launch on cuda:0. ``torch.cuda.device`` makes the tensor's device current
    for the launch (so its current stream is the one used) and restores the previous one on exit.
    No-op for CPU tensors (the interpreter has no device).
    """
    if tensor.device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(tensor.device)


def per_row_arg(value, batch: int, dtype: torch.dtype, dummy: torch.Tensor):
    """How a kernel takes a per-sequence parameter that is a number or a [B] (or [1]) tensor:
    (per_row, scalar, pointer, stride). A tensor is moved to ``dummy``'s device and dtype and
    broadcast to [B] (stride 0 for one value); a number goes as a scalar with ``dummy`` as the
    (never read) pointer."""
    if isinstance(value, torch.Tensor):
        t = value.to(device=dummy.device, dtype=dtype).reshape(-1).expand(batch)
        return True, (1.0 if dtype.is_floating_point else 0), t, t.stride(0)
    return False, (float(value) if dtype.is_floating_point else int(value)), dummy, 0


def decay_arg(decay, batch: int, dummy: torch.Tensor):
    """(DECAY, DECAY_PER_ROW, scalar, pointer, stride) for the attention kernels. DECAY is False for
    a plain 1.0, which compiles the score update without any multiply (the paper's sum)."""
    per_row, scalar, ptr, stride = per_row_arg(decay, batch, torch.float32, dummy)
    return per_row or scalar != 1.0, per_row, scalar, ptr, stride


@triton.jit
def row_scalar(PTR, scalar, b, stride, PER_ROW: tl.constexpr):
    """Sequence ``b``'s value of a per-sequence parameter: PTR[b * stride] or the scalar."""
    if PER_ROW:
        v = tl.load(PTR + b * stride)
    else:
        v = scalar
    return v


@triton.jit
def int_pow(base, n):
    """``base ** n`` in fp32 for integer n >= 0, as torch.pow computes it: 0 ** 0 = 1 (with decay 0
    the last real row keeps its weight), 0 ** n = 0, negative bases keep the sign of odd powers.
    exp2(n * log2|base|) only ever sees a positive base, so no log2(0) = -inf and no -inf * 0 = NaN
    is formed (the interpreter would warn about it, and the NaN would need masking)."""
    mag = tl.abs(base)
    nonzero = mag > 0
    r = tl.exp2(tl.log2(tl.where(nonzero, mag, 1.0)) * n.to(tl.float32))
    r = tl.where(nonzero, r, 0.0)
    r = tl.where(n == 0, 1.0, r)
    # (no `&` of the scalar and the vector condition: the interpreter cannot and a 0-d bool with one)
    return tl.where(base < 0, tl.where((n % 2) == 1, -r, r), r)
