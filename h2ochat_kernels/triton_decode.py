"""Fused decode attention with H2O score accumulation (one new query token per sequence).

Equals ``reference.attend_with_scores`` for Q == 1. Flash-decoding layout:

1. ``_decode_split_kernel``, grid (B * Hkv, num_splits). Each program owns a contiguous range of
   cache slots of one (sequence, KV head). It loads the G query heads of the group once (rows padded
   to a block of >= 16 so tl.dot compiles on a GPU), then streams its K and V blocks exactly once:
   logits = q @ K^T for all G heads in one tl.dot, masked by slot validity (slot_token_index < 0),
   online softmax (running max / sum / unnormalised P @ V). It writes its partial max, sum and output
   and, when scoring, the raw fp32 logits of its slots to a workspace [B * Hkv, G, S].
2. ``_decode_combine_kernel``, grid (B * Hkv, num_splits). Every program combines the (few) partial
   max/sum values with the new token's own logit into the global softmax statistics; program 0 of
   each (sequence, head) also combines the partial outputs, adds the new token's value and writes the
   output and the new token's score; every program then turns the workspace logits of its slot range
   into normalised probabilities, sums them over G and adds them to ``scores`` (each slot belongs to
   exactly one program: no atomics). With a score decay (``decay`` != 1, a float or one per
   sequence) that same read-modify-write multiplies the old score first: S <- decay * S + p, for
   real tokens only (a padding token, or a decode step's row an active mask leaves out, which comes
   as one, leaves the scores as they were).

Quantised slots (``quant``: int8 / int4 codes, ``h2ochat_kernels.quant``): the split kernel loads a
block's uint8 codes (int4: the byte holding each channel, shifted and masked), dequantises them with
the slot's float32 scale and offset (``_common.slot_rows``) to the query's dtype and runs the same
dots; nothing else changes. Per slot and head it reads D (int8) or D / 2 (int4) bytes of codes and 8
of scale and offset, for K and for V, where fp16 slots read 2 D: at D = 128, 0.53x (int8) and 0.28x
(int4) of the fp16 K/V bytes. The new token is never quantised here: the combine reads it at full precision.

K and V are read once; the scoring costs the workspace write + read (G * 4 bytes each per slot) and
the read-modify-write of ``scores`` (8 bytes per slot), about 8 % of the K/V bytes at G = 4,
head_dim 128, fp16. ``score=False`` removes all of it (the benchmark uses it to show that cost).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import (MASKED, check_float, check_quant, decay_arg, dot_mode, interpreting, launch_guard, next_pow2,
                      quant_args, quant_bits, row_scalar, slot_rows)


@triton.jit
def _decode_split_kernel(
    Q, K, V, SLOT, WS, PART_M, PART_L, PART_ACC,
    scale, S, G, D, H, split_len, num_splits,
    sqb, sqh, sqg, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    sib, sih, sis,
    KS, KO, VS, VO,
    sksb, sksh, skss, skob, skoh, skos, svsb, svsh, svss, svob, svoh, svos,
    key_width, value_width,
    MASKED_LOGIT: tl.constexpr, KV_BITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    SCORE: tl.constexpr, HALF_DOT: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D

    q = tl.load(Q + b * sqb + h * sqh + offs_g[:, None] * sqg + offs_d[None, :] * sqd,
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if not HALF_DOT:
        q = q.to(tl.float32)
    elif KV_BITS == 0:
        q = q.to(K.dtype.element_ty)
    # (quantised slots with a 16-bit query: the query keeps its dtype, the dequantised rows take it)

    m_i = tl.full([BLOCK_G], MASKED_LOGIT, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    i_base = SLOT + b * sib + h * sih
    ws_base = WS + bh.to(tl.int64) * G * S
    ks_base, ko_base = KS + b * sksb + h * sksh, KO + b * skob + h * skoh
    vs_base, vo_base = VS + b * svsb + h * svsh, VO + b * svob + h * svoh

    start = split * split_len
    end = tl.minimum(start + split_len, S)
    for s0 in range(start, end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        in_range = offs_s < end
        k = slot_rows(k_base, ks_base, ko_base, offs_s, offs_d, sks, skd, skss, skos, key_width, in_range, mask_d,
                      KV_BITS)
        if KV_BITS != 0:  # dequantised to the query's dtype, as the reference does
            k = k.to(Q.dtype.element_ty)
        tok = tl.load(i_base + offs_s * sis, mask=in_range, other=-1)
        if HALF_DOT:
            logits = tl.dot(q, tl.trans(k))
        else:
            logits = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        logits = logits * scale
        logits = tl.where((tok >= 0)[None, :], logits, MASKED_LOGIT)
        logits = tl.where(in_range[None, :], logits, float("-inf"))
        if SCORE:
            tl.store(ws_base + offs_g[:, None] * S + offs_s[None, :], logits,
                     mask=mask_g[:, None] & in_range[None, :])
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = slot_rows(v_base, vs_base, vo_base, offs_s, offs_d, svs, svd, svss, svos, value_width, in_range, mask_d,
                      KV_BITS)
        if KV_BITS != 0:
            v = v.to(Q.dtype.element_ty)
        if HALF_DOT:
            pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    part = bh.to(tl.int64) * num_splits + split
    # only the G real rows: the combine reads these back once per split
    tl.store(PART_M + part * BLOCK_G + offs_g, m_i, mask=mask_g)
    tl.store(PART_L + part * BLOCK_G + offs_g, l_i, mask=mask_g)
    tl.store(PART_ACC + (part * BLOCK_G + offs_g[:, None]) * BLOCK_D + offs_d[None, :], acc,
             mask=mask_g[:, None])


@triton.jit
def _decode_combine_kernel(
    Q, NK, NV, VALID, WS, PART_M, PART_L, PART_ACC, SCORES, OUT, NEW_SCORES, DECAY_PTR,
    scale, decay, S, G, D, H, split_len, num_splits,
    sqb, sqh, sqg, sqd,
    snkb, snkh, snkd,
    snvb, snvh, snvd,
    svalb,
    ssb, ssh, sss,
    sob, soh, sog, sod,
    sdecb,
    MASKED_LOGIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
    SCORE: tl.constexpr, HAS_VALID: tl.constexpr, DECAY: tl.constexpr, DECAY_PER_ROW: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, BLOCK_P)
    mask_g = offs_g < G
    mask_d = offs_d < D

    if HAS_VALID:
        real = tl.load(VALID + b * svalb).to(tl.int32) != 0
    else:
        real = True

    # The new token's logit (it is its own causal key; masked when it is padding).
    q = tl.load(Q + b * sqb + h * sqh + offs_g[:, None] * sqg + offs_d[None, :] * sqd,
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    nk = tl.load(NK + b * snkb + h * snkh + offs_d * snkd, mask=mask_d, other=0.0).to(tl.float32)
    new_logit = tl.sum(q * nk[None, :], axis=1) * scale
    new_logit = tl.where(real, new_logit, MASKED_LOGIT)

    # Global softmax statistics from the partials.
    part0 = bh.to(tl.int64) * num_splits
    pm_mask = (offs_p < num_splits)[:, None] & mask_g[None, :]
    pm = tl.load(PART_M + (part0 + offs_p[:, None]) * BLOCK_G + offs_g[None, :], mask=pm_mask,
                 other=float("-inf"))
    pl = tl.load(PART_L + (part0 + offs_p[:, None]) * BLOCK_G + offs_g[None, :], mask=pm_mask,
                 other=0.0)
    m = tl.maximum(tl.max(pm, axis=0), new_logit)
    w = tl.exp(pm - m[None, :])
    new_p = tl.exp(new_logit - m)
    l = tl.sum(pl * w, axis=0) + new_p
    inv_l = 1.0 / l

    if split == 0:
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for s in range(0, num_splits):
            pm_s = tl.load(PART_M + (part0 + s) * BLOCK_G + offs_g, mask=mask_g, other=float("-inf"))
            part_acc = tl.load(PART_ACC + ((part0 + s) * BLOCK_G + offs_g[:, None]) * BLOCK_D + offs_d[None, :],
                               mask=mask_g[:, None], other=0.0)
            acc += part_acc * tl.exp(pm_s - m)[:, None]
        nv = tl.load(NV + b * snvb + h * snvh + offs_d * snvd, mask=mask_d, other=0.0).to(tl.float32)
        acc += new_p[:, None] * nv[None, :]
        out = acc * inv_l[:, None]
        tl.store(OUT + b * sob + h * soh + offs_g[:, None] * sog + offs_d[None, :] * sod,
                 out.to(OUT.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
        new_score = tl.sum(tl.where(mask_g, new_p * inv_l, 0.0), axis=0)
        new_score = tl.where(real, new_score, 0.0)
        tl.store(NEW_SCORES + bh, new_score)

    if SCORE:
        # One query row: a real one multiplies the old scores by decay ** 1 and adds its own
        # probabilities with weight decay ** 0 = 1 (also for decay 0); a padding row changes nothing.
        if real:
            if DECAY:
                d = row_scalar(DECAY_PTR, decay, b, sdecb, DECAY_PER_ROW).to(tl.float32)
            ws_base = WS + bh.to(tl.int64) * G * S
            s_base = SCORES + b * ssb + h * ssh
            start = split * split_len
            end = tl.minimum(start + split_len, S)
            for s0 in range(start, end, BLOCK_S):
                offs_s = s0 + tl.arange(0, BLOCK_S)
                in_range = offs_s < end
                logits = tl.load(ws_base + offs_g[:, None] * S + offs_s[None, :],
                                 mask=mask_g[:, None] & in_range[None, :], other=float("-inf"))
                p = tl.exp(logits - m[:, None]) * inv_l[:, None]
                col = tl.sum(p, axis=0)
                old = tl.load(s_base + offs_s * sss, mask=in_range, other=0.0)
                if DECAY:
                    old = old * d
                tl.store(s_base + offs_s * sss, old + col, mask=in_range)


@functools.lru_cache(maxsize=None)
def _sm_count_cuda(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count_cuda(device.index if device.index is not None else torch.cuda.current_device())
    return 8


def plan_splits(bh: int, slots: int, block_s: int, device: torch.device, num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, split_len): split_len a multiple of block_s, enough programs to fill the device."""
    blocks = max(1, triton.cdiv(slots, block_s))
    if num_splits is None:
        # ~4 programs per SM, but on a GPU no split shorter than 4 blocks and at most 32 splits:
        # program 0 of the combine reads every split's partial output (G * D * 4 bytes each).
        target = 4 * _sm_count(device)
        on_gpu = device.type == "cuda"
        num_splits = max(1, min(triton.cdiv(target, bh), blocks // 4 if on_gpu else blocks))
        if on_gpu:
            num_splits = min(num_splits, 32)
    num_splits = max(1, min(int(num_splits), blocks))
    split_len = triton.cdiv(blocks, num_splits) * block_s
    num_splits = triton.cdiv(slots, split_len) if slots > 0 else 1
    return num_splits, split_len


def decode_attend_with_scores(
    query: torch.Tensor,
    cache_keys: torch.Tensor,
    cache_values: torch.Tensor,
    slot_token_index: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    new_valid: torch.Tensor | None,
    scale: float,
    scores: torch.Tensor | None,
    *,
    score: bool = True,
    num_splits: int | None = None,
    block_s: int | None = None,
    out: torch.Tensor | None = None,
    decay: float | torch.Tensor = 1.0,
    quant=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.attend_with_scores`` for Q == 1 (see the module docstring).

    ``quant`` (``quant.QuantSlots`` or None): the slots are int8 / int4 codes, dequantised in the
    split kernel as each block is loaded (the new token is full precision, read by the combine).

    ``decay`` (a float or a [B] tensor) is the reference's score decay: a real token multiplies the
    old scores by it before adding its probabilities. ``score=False`` skips the score bookkeeping (``scores`` is then left alone and may be None).
    ``num_splits`` / ``block_s`` override the launch plan (tests use them to cover split edges);
    ``out`` (shape and dtype of the result) receives the output instead of a fresh tensor.
    """
    batch, kv_heads, group, q_len, head_dim = query.shape
    if q_len != 1:
        raise ValueError(f"decode kernel takes one query token, got {q_len}")
    slots = cache_keys.shape[2]
    check_quant(quant, query, cache_keys, cache_values)
    if quant is not None and slots == 0:
        quant = None  # no slot to dequantise: the float path over dummy tensors below
    elif quant is None:
        for name, t in (("query", query), ("cache_keys", cache_keys), ("cache_values", cache_values)):
            check_float(t, name)
        if cache_keys.dtype != cache_values.dtype:
            raise TypeError("cache_keys and cache_values must share a dtype")
    device = query.device
    # the dtype the dots take their inputs in: the slots' own, or (quantised) the query's
    dot_dtype = cache_keys.dtype if quant is None else query.dtype

    if out is None:
        out = torch.empty(batch, kv_heads, group, 1, head_dim, dtype=query.dtype, device=device)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError("out must have the query's shape and dtype")
    new_scores = torch.empty(batch, kv_heads, 1, dtype=torch.float32, device=device)

    block_g = max(16, next_pow2(group))
    block_d = max(16, next_pow2(head_dim))
    num_stages = 3
    if block_s is None:
        if interpreting():
            block_s = 16
        elif dot_mode(dot_dtype):  # 16-bit: ~24 KiB of shared memory at D = 128
            block_s = 64 if block_d <= 128 else 32
        else:  # fp32 tiles are twice the bytes: fit the ~100 KiB of consumer GPUs
            block_s, num_stages = (32 if block_d <= 128 else 16), 2
    bh = batch * kv_heads
    splits, split_len = plan_splits(bh, slots, block_s, device, num_splits)
    block_p = max(2, next_pow2(splits))

    part_m = torch.empty(bh * splits * block_g, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(bh * splits * block_g * block_d, dtype=torch.float32, device=device)
    do_score = bool(score) and scores is not None and slots > 0
    ws = torch.empty(bh * group * slots if do_score else 1, dtype=torch.float32, device=device)
    if do_score:
        if scores.dtype != torch.float32:
            raise TypeError("scores must be float32")
        scores_arg, ss = scores, scores.stride()
    else:
        scores_arg, ss = part_m, (0, 0, 0)

    q = query.select(3, 0)
    if slots > 0:
        cache_k, cache_v, slot_idx = cache_keys, cache_values, slot_token_index
    else:  # nothing cached: run the split kernel over zero slots against dummy (never read) tensors
        cache_k = cache_v = new_keys[:, :, :1]
        slot_idx = torch.full((batch, kv_heads, 1), -1, dtype=torch.int64, device=device)
    half_dot = dot_mode(cache_k.dtype if quant is None else dot_dtype)
    has_decay, decay_per_row, decay_scalar, decay_ptr, sdec = decay_arg(decay, batch, part_m)
    # select(), not [..., 0]: the launch-guard test runs this on fake CUDA tensors, which a CPU-only
    # torch cannot index with Python subscripts
    nk, nv = new_keys.select(2, 0), new_values.select(2, 0)
    if new_valid is not None:
        valid_arg, sval = new_valid.select(1, 0), new_valid.stride(0)
    else:
        valid_arg, sval = part_m, 0
    o = out.select(3, 0)

    with launch_guard(query):
        _decode_split_kernel[(bh, splits)](
            q, cache_k, cache_v, slot_idx, ws, part_m, part_l, part_acc,
            float(scale), slots, group, head_dim, kv_heads, split_len, splits,
            *q.stride(), *cache_k.stride(), *cache_v.stride(), *slot_idx.stride(),
            *quant_args(quant, cache_k, cache_v, part_m),
            MASKED_LOGIT=MASKED, KV_BITS=quant_bits(quant), BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_S=block_s,
            SCORE=do_score, HALF_DOT=half_dot, num_warps=4, num_stages=num_stages,
        )
        _decode_combine_kernel[(bh, splits if do_score else 1)](
            q, nk, nv, valid_arg, ws, part_m, part_l, part_acc, scores_arg, o, new_scores, decay_ptr,
            float(scale), decay_scalar, slots, group, head_dim, kv_heads, split_len, splits,
            *q.stride(), *nk.stride(), *nv.stride(), sval, *ss, *o.stride(), sdec,
            MASKED_LOGIT=MASKED, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_P=block_p,
            SCORE=do_score, HAS_VALID=new_valid is not None, DECAY=has_decay and do_score,
            DECAY_PER_ROW=decay_per_row,
        )
    return out, new_scores
