"""Re-numbering cached keys for rotary (RoPE) models.

A RoPE key computed at position p is the raw key rotated by p * inv_freq. Rotations compose, so
moving a cached key to position p' is one more rotation by (p' - p): no raw keys need to be kept.
Llama and GPT-NeoX use the "rotate half" layout; GPT-NeoX rotates only the first dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rotary:
    inv_freq: torch.Tensor  # [rotary_dim // 2], float32
    rotary_dim: int


def find_rotary(model: torch.nn.Module) -> Rotary | None:
    """The model's rotary embedding, or None for models with learned absolute positions (OPT)."""
    for name, module in model.named_modules():
        inv_freq = getattr(module, "inv_freq", None)
        if name.endswith("rotary_emb") and isinstance(inv_freq, torch.Tensor):
            inv_freq = inv_freq.detach().float()
            return Rotary(inv_freq=inv_freq, rotary_dim=2 * inv_freq.numel())
    return None


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, rotary: Rotary) -> None:
    """Rotate ``keys`` [B, H, S, D] in place by ``delta`` [B, H, S] positions."""
    dim = rotary.rotary_dim
    half = dim // 2
    # angles in float64: an fp32 angle of a move by ~1e5 positions is off by ~1e5 * 2^-24 rad, and
    # that error adds up over re-numberings (fp16 keys drifted 2x their rounding over 50 of them)
    angles = delta.to(torch.float64).unsqueeze(-1) * rotary.inv_freq.to(keys.device, torch.float64)
    cos, sin = angles.cos().to(torch.float32), angles.sin().to(torch.float32)
    part = keys[..., :dim].to(torch.float32)
    first, second = part[..., :half], part[..., half:]
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    keys[..., :dim] = rotated.to(keys.dtype)
