"""The fixed spreading rotation that low-bit keys are turned by before the quantiser (``quant``) codes
them: the int4 KV slots' keys (``h2ochat.kv.slot_format``) and the recall digest's keys
(``h2ochat.recall.digests``) share it, so both tiers and the kernels agree on one matrix."""

from __future__ import annotations

import functools

import torch


def spreading_rotation(dim: int, device=None) -> torch.Tensor:
    """A fixed orthogonal D x D matrix that spreads every channel over all the others: a Walsh-Hadamard
    matrix with seeded random signs (power-of-two D), else a seeded random orthogonal matrix. Keys
    have a few outlier channels that set a per-token quantiser's range and flatten every other channel
    to a level or two; rotated (q R).(k R) = q.k, and the rotated key's channels are all alike (the
    rotation QuaRot applies before quantising). Same matrix for every call: digests and queries agree;
    made once per (D, device) and shared (nobody writes it)."""
    return _spreading_rotation(dim, torch.device(device if device is not None else "cpu"))


@functools.lru_cache(maxsize=None)
def _spreading_rotation(dim: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0x5EED + dim)
    if dim & (dim - 1) == 0:
        matrix = torch.ones(1, 1)
        while matrix.shape[0] < dim:
            matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
        signs = torch.randint(0, 2, (dim,), generator=generator) * 2 - 1
        matrix = signs.float().unsqueeze(1) * matrix / dim ** 0.5
    else:
        matrix, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator))
    return matrix.to(device)
