"""Decode-step eviction (``reference.evict_and_insert``) as one Triton kernel.

Decision: a Triton kernel on CUDA, the torch reference everywhere else.

The work is tiny (read S priorities, write one slot of K, V, score, token index and position per
(sequence, KV head)), so its cost on a GPU is launch overhead, not bandwidth. The torch version is
seven launches (argmin, gather, five scatter_) plus the dtype casts and expands it needs, per layer
per decoded token; at ~4-6 us of launch + scheduling each that is ~30-40 us per layer, ~1 ms per
token for a 30-layer model, which is comparable to the whole decode attention of a short context.
The kernel does it in one launch with one program per (sequence, KV head): a blocked argmin over
the priorities (ties to the lowest index, as torch.argmin), then the in-place writes.

What was measured: this session had no GPU, so neither version could be timed on CUDA; only the
torch path was timed on the CPU (``benchmarks/bench_kernels.py`` reports it, roughly 20-60 us per
call at the sizes there, dominated by per-op overhead, which supports the launch-count argument).
The kernel's correctness was checked under TRITON_INTERPRET=1 against the reference, including ties
and all-protected (+inf) rows. Re-check the launch-count argument with the benchmark's
``evict`` section on a GPU; CUDA graphs would shrink the torch version's overhead as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting, next_pow2


@triton.jit
def _evict_kernel(
    PRI, K, V, SC, IDX, POS, NK, NV, NS, NTI, NPOS, DROPPED, DROPPED_SCORE,
    S, D, H,
    spb, sph, sps,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    scb, sch, scs,
    sib, sih, sis,
    spob, spoh, spos,
    snkb, snkh, snkd,
    snvb, snvh, snvd,
    snsb, snsh,
    sntb, snpb,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)

    p_base = PRI + b * spb + h * sph
    best = tl.load(p_base).to(tl.float32)
    best_i = (bh * 0).to(tl.int64)
    for s0 in range(0, S, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        pr = tl.load(p_base + offs * sps, mask=offs < S, other=float("inf")).to(tl.float32)
        bmin = tl.min(pr, axis=0)
        # lowest index holding the block minimum (explicit, not relying on argmin's tie rule)
        barg = tl.min(tl.where((pr == bmin) & (offs < S), offs, S), axis=0).to(tl.int64)
        better = bmin < best
        best_i = tl.where(better, barg, best_i)
        best = tl.where(better, bmin, best)

    slot = best_i
    dropped = tl.load(IDX + b * sib + h * sih + slot * sis)
    tl.store(DROPPED + bh, dropped)
    tl.store(DROPPED_SCORE + bh, tl.load(SC + b * scb + h * sch + slot * scs))

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    nk = tl.load(NK + b * snkb + h * snkh + offs_d * snkd, mask=mask_d)
    tl.store(K + b * skb + h * skh + slot * sks + offs_d * skd, nk.to(K.dtype.element_ty), mask=mask_d)
    nv = tl.load(NV + b * snvb + h * snvh + offs_d * snvd, mask=mask_d)
    tl.store(V + b * svb + h * svh + slot * svs + offs_d * svd, nv.to(V.dtype.element_ty), mask=mask_d)
    tl.store(SC + b * scb + h * sch + slot * scs, tl.load(NS + b * snsb + h * snsh).to(tl.float32))
    tl.store(IDX + b * sib + h * sih + slot * sis, tl.load(NTI + b * sntb).to(tl.int64))
    tl.store(POS + b * spob + h * spoh + slot * spos, tl.load(NPOS + b * snpb).to(tl.int64))


def evict_and_insert(
    priority: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    slot_token_index: torch.Tensor,
    slot_position: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    new_score: torch.Tensor,
    new_token_index: torch.Tensor,
    new_position: torch.Tensor,
    *,
    block_s: int | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.evict_and_insert``; one launch for the whole batch."""
    batch, kv_heads, slots, head_dim = keys.shape
    if slots == 0:
        raise ValueError("evict_and_insert needs at least one slot")
    if scores.dtype != torch.float32 or slot_token_index.dtype != torch.int64 or slot_position.dtype != torch.int64:
        raise TypeError("scores must be float32, slot_token_index and slot_position int64")
    # Mixed half/float copies in the interpreter would read raw bf16 bits: convert on the torch side.
    if new_key.dtype != keys.dtype:
        new_key = new_key.to(keys.dtype)
    if new_value.dtype != values.dtype:
        new_value = new_value.to(values.dtype)
    if interpreting() and priority.dtype == torch.bfloat16:
        priority = priority.float()
    dropped = torch.empty(batch, kv_heads, dtype=torch.int64, device=keys.device)
    dropped_score = torch.empty(batch, kv_heads, dtype=torch.float32, device=keys.device)
    if block_s is None:
        block_s = min(1024, max(16, next_pow2(slots)))
    nk, nv = new_key[:, :, 0], new_value[:, :, 0]
    _evict_kernel[(batch * kv_heads,)](
        priority, keys, values, scores, slot_token_index, slot_position,
        nk, nv, new_score, new_token_index, new_position, dropped, dropped_score,
        slots, head_dim, kv_heads,
        *priority.stride(), *keys.stride(), *values.stride(), *scores.stride(),
        *slot_token_index.stride(), *slot_position.stride(),
        *nk.stride(), *nv.stride(), *new_score.stride(),
        new_token_index.stride(0), new_position.stride(0),
        BLOCK_S=block_s, BLOCK_D=max(16, next_pow2(head_dim)),
    )
    return dropped, dropped_score
