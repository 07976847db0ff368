"""Decode-step eviction as one Triton kernel: ``reference.evict_and_insert`` (a priority tensor
given) and ``reference.evict_by_policy`` (the priority computed from the policy's parameters).

Decision: a Triton kernel on CUDA, the torch reference everywhere else.

The work is tiny (read S priorities, write one slot of K, V, score, token index, position and value
norm per (sequence, KV head)), so its cost on a GPU is launch overhead, not bandwidth. The torch
eviction is seven launches (argmin, gather, five scatter_) plus the dtype casts and expands it needs,
per layer per decoded token, and the policy's priority (rank, age, protected window and sinks,
empty slots) is ~10 more; at ~4-6 us of launch + scheduling each that is tens of us per layer,
~1-2 ms per token for a 30-layer model, comparable to the whole decode attention of a short context.
The kernel does it in one launch with one program per (sequence, KV head): the priority of a block
of slots (read from the priority tensor, or computed from score / token index / age / value norm,
the recent window and the sinks: constexpr rank kinds, ``recent``/``sinks`` scalars or per-sequence
pointers), a blocked argmin (ties to the lowest index, as torch.argmin), then the in-place writes
(skipped in a row an ``active`` mask leaves out: it reports nothing dropped).

What was measured: no GPU was available when this was written, so neither version has been timed on
CUDA; the torch paths were timed on the CPU (``benchmarks/bench_kernels.py``, evict section: tens of
us per call, dominated by per-op overhead, which supports the launch-count argument). Correctness was
checked under TRITON_INTERPRET=1 against the reference (ties, all-protected rows, empty slots,
per-sequence windows, by-age and value-norm ranks, strided views). Re-check the launch-count argument
with the benchmark's evict section on a GPU; CUDA graphs would shrink the torch version's overhead too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting, launch_guard, next_pow2, per_row_arg, row_scalar

# What a slot's merit (before the protected and empty slots are marked) is read from.
RANK_GIVEN, RANK_SCORE, RANK_TOKEN = 0, 1, 2


@triton.jit
def _policy_priority(sc, tok, norm, newest, recent, sinks, value_eps,
                     RANK: tl.constexpr, BY_AGE: tl.constexpr, VALUE_EPS: tl.constexpr):
    """reference.keep_priority(reference.slot_rank(...)) for one block of slots, in the same fp32
    operations so the argmin picks the same slot (tl.div_rn: a GPU's default fp32 division is not
    correctly rounded, and score / age ties, e.g. 1/3 and 2/6, must stay ties)."""
    if RANK == 2:
        rank = tok.to(tl.float32)
    else:
        rank = sc
        if BY_AGE:
            rank = tl.div_rn(rank, tl.maximum(newest - tok + 1, 1).to(tl.float32))
        if VALUE_EPS:
            rank = (rank + value_eps) * norm
    protected = (tok > newest - recent) | ((tok >= 0) & (tok < sinks))
    priority = tl.where(protected, float("inf"), rank)
    return tl.where(tok < 0, float("-inf"), priority)


@triton.jit
def _evict_kernel(
    PRI, K, V, SC, IDX, POS, NORM, NK, NV, NS, NTI, NPOS, NNORM, RECENT, SINKS, ACTIVE, DROPPED, DROPPED_SCORE,
    S, D, H, recent, sinks, value_eps,
    spb, sph, sps,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    scb, sch, scs,
    sib, sih, sis,
    spob, spoh, spos,
    snb, snh, sns,
    snkb, snkh, snkd,
    snvb, snvh, snvd,
    snsb, snsh,
    snnb, snnh,
    sntb, snpb, srecb, ssinkb, sactb,
    RANK: tl.constexpr, BY_AGE: tl.constexpr, VALUE_EPS: tl.constexpr, HAS_NORM: tl.constexpr,
    RECENT_PER_ROW: tl.constexpr, SINKS_PER_ROW: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    i_base = IDX + b * sib + h * sih
    s_base = SC + b * scb + h * sch

    if RANK != 0:
        newest = tl.load(NTI + b * sntb).to(tl.int64)
        row_recent = row_scalar(RECENT, recent, b, srecb, RECENT_PER_ROW)
        row_sinks = row_scalar(SINKS, sinks, b, ssinkb, SINKS_PER_ROW)

    # Blocked argmin, ties to the lowest slot as torch.argmin; all +inf (every slot protected) -> 0.
    best = (bh * 0).to(tl.float32) + float("inf")
    best_i = (bh * 0).to(tl.int64)
    for s0 in range(0, S, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        in_range = offs < S
        if RANK == 0:
            pr = tl.load(PRI + b * spb + h * sph + offs * sps, mask=in_range, other=float("inf")).to(tl.float32)
        else:
            tok = tl.load(i_base + offs * sis, mask=in_range, other=0)
            sc = tl.load(s_base + offs * scs, mask=in_range, other=0.0)
            if VALUE_EPS:
                norm = tl.load(NORM + b * snb + h * snh + offs * sns, mask=in_range, other=0.0)
            else:
                norm = sc
            pr = _policy_priority(sc, tok, norm, newest, row_recent, row_sinks, value_eps, RANK, BY_AGE, VALUE_EPS)
            pr = tl.where(in_range, pr, float("inf"))
        bmin = tl.min(pr, axis=0)
        # lowest index holding the block minimum (explicit, not relying on argmin's tie rule)
        barg = tl.min(tl.where((pr == bmin) & in_range, offs, S), axis=0).to(tl.int64)
        better = bmin < best
        best_i = tl.where(better, barg, best_i)
        best = tl.where(better, bmin, best)

    slot = best_i
    if HAS_ACTIVE:  # a row left out (finished in a burst of decode steps) writes nothing
        write = tl.load(ACTIVE + b * sactb).to(tl.int32) != 0
    else:
        write = True
    if write:
        tl.store(DROPPED + bh, tl.load(i_base + slot * sis))
        tl.store(DROPPED_SCORE + bh, tl.load(s_base + slot * scs))
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        nk = tl.load(NK + b * snkb + h * snkh + offs_d * snkd, mask=mask_d)
        tl.store(K + b * skb + h * skh + slot * sks + offs_d * skd, nk.to(K.dtype.element_ty), mask=mask_d)
        nv = tl.load(NV + b * snvb + h * snvh + offs_d * snvd, mask=mask_d)
        tl.store(V + b * svb + h * svh + slot * svs + offs_d * svd, nv.to(V.dtype.element_ty), mask=mask_d)
        tl.store(s_base + slot * scs, tl.load(NS + b * snsb + h * snsh).to(tl.float32))
        tl.store(i_base + slot * sis, tl.load(NTI + b * sntb).to(tl.int64))
        tl.store(POS + b * spob + h * spoh + slot * spos, tl.load(NPOS + b * snpb).to(tl.int64))
        if HAS_NORM:
            tl.store(NORM + b * snb + h * snh + slot * sns, tl.load(NNORM + b * snnb + h * snnh).to(tl.float32))
    else:  # as the reference: nothing dropped
        tl.store(DROPPED + bh, best_i * 0 - 1)
        tl.store(DROPPED_SCORE + bh, (bh * 0).to(tl.float32))


def _launch(priority, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
            new_token_index, new_position, value_norm, new_value_norm, active=None, *, rank, by_age=False,
            value_eps=None, recent=0, sinks=0, block_s=None):
    batch, kv_heads, slots, head_dim = keys.shape
    if slots == 0:
        raise ValueError("eviction needs at least one slot")
    if scores.dtype != torch.float32 or slot_token_index.dtype != torch.int64 or slot_position.dtype != torch.int64:
        raise TypeError("scores must be float32, slot_token_index and slot_position int64")
    if value_norm is not None and (value_norm.dtype != torch.float32 or new_value_norm is None):
        raise TypeError("value_norm must be float32 and come with new_value_norm")
    if value_eps is not None and rank == RANK_SCORE and value_norm is None:
        raise ValueError("value_eps ranks by the value norm: value_norm is required")
    for name, value in (("recent", recent), ("sinks", sinks)):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            raise TypeError(f"{name}: expected an int or an integer tensor")
    # Mixed half/float copies in the interpreter would read raw bf16 bits: convert on the torch side.
    if new_key.dtype != keys.dtype:
        new_key = new_key.to(keys.dtype)
    if new_value.dtype != values.dtype:
        new_value = new_value.to(values.dtype)
    if new_value_norm is not None and new_value_norm.dtype != torch.float32:
        new_value_norm = new_value_norm.float()
    if priority is None:
        priority = scores  # never read (RANK != 0); gives the kernel a pointer
        sp = (0, 0, 0)
    else:
        if interpreting() and priority.dtype == torch.bfloat16:
            priority = priority.float()
        sp = priority.stride()
    if value_norm is None:
        norm, sn, new_norm, snn = scores, (0, 0, 0), new_score, (0, 0)  # never read nor written
    else:
        norm, sn, new_norm, snn = value_norm, value_norm.stride(), new_value_norm, new_value_norm.stride()
    recent_row, recent_val, recent_ptr, srec = per_row_arg(recent, batch, torch.int64, new_token_index)
    sinks_row, sinks_val, sinks_ptr, ssink = per_row_arg(sinks, batch, torch.int64, new_token_index)
    if active is not None and active.dtype != torch.bool:
        raise TypeError("active must be a bool tensor [B]")
    active_ptr, sact = (active, active.stride(0)) if active is not None else (new_token_index, 0)

    dropped = torch.empty(batch, kv_heads, dtype=torch.int64, device=keys.device)
    dropped_score = torch.empty(batch, kv_heads, dtype=torch.float32, device=keys.device)
    if block_s is None:
        block_s = min(1024, max(16, next_pow2(slots)))
    nk, nv = new_key.select(2, 0), new_value.select(2, 0)  # select(): see triton_decode
    with launch_guard(keys):
        _evict_kernel[(batch * kv_heads,)](
            priority, keys, values, scores, slot_token_index, slot_position, norm,
            nk, nv, new_score, new_token_index, new_position, new_norm, recent_ptr, sinks_ptr, active_ptr,
            dropped, dropped_score,
            slots, head_dim, kv_heads, recent_val, sinks_val, float(value_eps or 0.0),
            *sp, *keys.stride(), *values.stride(), *scores.stride(),
            *slot_token_index.stride(), *slot_position.stride(), *sn,
            *nk.stride(), *nv.stride(), *new_score.stride(), *snn,
            new_token_index.stride(0), new_position.stride(0), srec, ssink, sact,
            RANK=rank, BY_AGE=bool(by_age) and rank == RANK_SCORE,
            VALUE_EPS=value_eps is not None and rank == RANK_SCORE, HAS_NORM=value_norm is not None,
            RECENT_PER_ROW=recent_row, SINKS_PER_ROW=sinks_row, HAS_ACTIVE=active is not None,
            BLOCK_S=block_s, BLOCK_D=max(16, next_pow2(head_dim)),
        )
    return dropped, dropped_score


def evict_and_insert(priority, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                     new_token_index, new_position, value_norm=None, new_value_norm=None, active=None, *,
                     block_s=None):
    """Same contract as ``reference.evict_and_insert``; one launch for the whole batch."""
    return _launch(priority, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                   new_token_index, new_position, value_norm, new_value_norm, active, rank=RANK_GIVEN,
                   block_s=block_s)


def evict_by_policy(keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                    new_token_index, new_position, value_norm=None, new_value_norm=None, active=None, *, recent,
                    sinks, oldest_first=False, by_age=False, value_eps=None, block_s=None):
    """Same contract as ``reference.evict_by_policy``: the priority is computed in the kernel from
    the policy's parameters (``recent``/``sinks`` ints or [B] integer tensors), one launch."""
    return _launch(None, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                   new_token_index, new_position, value_norm, new_value_norm, active,
                   rank=RANK_TOKEN if oldest_first else RANK_SCORE, by_age=by_age, value_eps=value_eps,
                   recent=recent, sinks=sinks, block_s=block_s)
