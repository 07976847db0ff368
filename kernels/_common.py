"""Small helpers shared by the Triton kernel modules (no Triton import here)."""

from __future__ import annotations

import os

import torch

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
