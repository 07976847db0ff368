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

# Logit given to masked keys. It equals attention_rows.MASKED (float32 min), so a row with every key
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


def quant_args(quant, cache_keys: torch.Tensor, cache_values: torch.Tensor, dummy: torch.Tensor) -> tuple:
    """The launch arguments of a quantised cache (``quant.QuantSlots`` or None), in the order the
    attention kernels take them: the key scale, key offset, value scale and value offset pointers,
    their (b, h, s) strides and the code widths (bytes a slot) of keys and values (float slots: the
    pointers are ``dummy``, never read). The KV_BITS constexpr goes by keyword: ``quant_bits``."""
    if quant is None:
        return (dummy,) * 4 + (0,) * 12 + (0, 0)
    tensors = (quant.key_scale, quant.key_offset, quant.value_scale, quant.value_offset)
    for t in tensors:
        if t.dtype != torch.float32:
            raise TypeError(f"quantised slots: scales and offsets must be float32, got {t.dtype}")
    strides = tuple(s for t in tensors for s in t.stride())
    return tensors + strides + (cache_keys.shape[-1], cache_values.shape[-1])


def quant_bits(quant) -> int:
    """The attention kernels' KV_BITS: 0 for float slots, else the codes' bits."""
    return 0 if quant is None else int(quant.bits)


@triton.jit
def slot_rows(BASE, SCALE, OFFSET, offs_s, offs_d, sks, skd, sss, sos, width, in_range, mask_d,
              BITS: tl.constexpr):
    """A [BLOCK_S, BLOCK_D] block of cached keys or values: the stored floats (BITS 0, in their own
    dtype), or fp32 dequantised from their codes, code * scale + offset per slot (BITS 8: a code a
    byte; BITS 4: the channel-blocked nibbles of ``quant``, channel d in byte d (low nibble) or
    byte d - width (high nibble)). Slots outside ``in_range`` come out 0; channels past D come out as
    the slot's offset, which the masked (zero) query channels and the masked output stores ignore."""
    mask = in_range[:, None] & mask_d[None, :]
    if BITS == 0:
        rows = tl.load(BASE + offs_s[:, None] * sks + offs_d[None, :] * skd, mask=mask, other=0.0)
    else:
        if BITS == 4:
            high = offs_d >= width
            byte = tl.where(high, offs_d - width, offs_d)
        else:
            byte = offs_d
        codes = tl.load(BASE + offs_s[:, None] * sks + byte[None, :] * skd, mask=mask, other=0).to(tl.int32)
        if BITS == 4:
            codes = (codes >> tl.where(high, 4, 0)[None, :]) & 15
        scale = tl.load(SCALE + offs_s * sss, mask=in_range, other=0.0)
        offset = tl.load(OFFSET + offs_s * sos, mask=in_range, other=0.0)
        rows = codes.to(tl.float32) * scale[:, None] + offset[:, None]
    return rows


def check_quant(quant, query: torch.Tensor, cache_keys: torch.Tensor, cache_values: torch.Tensor) -> None:
    """What the kernels take as quantised slots (``quant`` None: nothing to check)."""
    if quant is None:
        return
    check_float(query, "query")
    if cache_keys.dtype != torch.uint8 or cache_values.dtype != torch.uint8:
        raise TypeError(f"quantised slots hold uint8 codes, got {cache_keys.dtype} and {cache_values.dtype}")
    if quant.bits not in (4, 8):
        raise ValueError(f"quantised slots of 4 or 8 bits, got {quant.bits}")
    head_dim = query.shape[-1]
    if quant.key_dim != head_dim or quant.value_dim != head_dim:
        raise ValueError(f"quantised slots of {quant.key_dim}/{quant.value_dim} channels for a head of {head_dim}")
    for name, codes in (("keys", cache_keys), ("values", cache_values)):
        if codes.shape[-1] != -(-head_dim // (8 // quant.bits)):
            raise ValueError(f"quantised {name}: {codes.shape[-1]} bytes a slot for {head_dim} channels "
                             f"of {quant.bits} bits")
