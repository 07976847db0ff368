"""Chunk (prefill) attention with H2O column scores: Q > 1 new tokens per sequence.

Equals ``reference.attend_with_scores`` for any Q. A score is a column sum of the NORMALISED
probabilities, which needs each row's final max and sum before any probability is known, so the
kernel makes two passes over the keys:

- pass 1: row max and sum of exponentials (online), over the cache slots and then over the new keys;
- pass 2: recompute the logits, p = exp(logit - max) / sum, accumulate p @ V (already normalised:
  no rescaling), and add the column sums of p over the real query rows to ``scores`` (cache slots)
  and to ``new_scores`` (new tokens) with fp32 atomic adds, since several row blocks share a key.

Score decay (``decay`` != 1, a float or one per sequence): S <- decay * S + a_t as if the tokens were
fed one at a time. Each row's probabilities are weighted by decay ** (real tokens after it) where
pass 2 adds them; the old scores' factor decay ** (real tokens) must be applied before any row block
adds, which no program of the same launch can order, so ``_decay_scores_kernel`` (one small launch,
only when decay != 1) does it first.

Grid: (B * Hkv, cdiv(G * Q, BLOCK_M)). The G query heads of a KV group are folded into the rows
(row r = token r // G, head r % G), so one program reads each K/V block for every head of its group,
and a row block covers a contiguous token range: new-key blocks past its last token are skipped
(causal). K is read twice and V once per row block; prefill is compute-bound enough that the second
K read is cheaper than a [rows, keys] probability workspace.

Quantised slots (``quant``): both passes load the slots' codes and dequantise them per block, as the
decode kernel does (``_common.slot_rows``, to the query's dtype); the new tokens are full precision
and must be in the query's dtype (one dtype for both operands of each dot).

Masks follow the reference: invalid cache slots, future new tokens and padding new tokens get the
float32-min logit (so an all-masked padding row gets a finite, uniform softmax), padding query rows
(new_valid False) add nothing to any score; their output is computed but meaningless.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (MASKED, check_float, check_quant, decay_arg, dot_mode, int_pow, interpreting, launch_guard,
                      next_pow2, quant_args, quant_bits, row_scalar, slot_rows)


@triton.jit
def _qk(q, k, HALF_DOT: tl.constexpr):
    if HALF_DOT:
        r = tl.dot(q, tl.trans(k))
    else:
        r = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    return r


@triton.jit
def _pv(p, v, HALF_DOT: tl.constexpr):
    if HALF_DOT:
        r = tl.dot(p.to(v.dtype), v)
    else:
        r = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return r


@triton.jit
def _slot_block(BASE, SCALE, OFFSET, offs_s, offs_d, sks, skd, sss, sos, width, in_range, mask_d, Qp,
                KV_BITS: tl.constexpr):
    """A block of cached keys or values: as stored, or dequantised to the query's dtype (the reference's)."""
    rows = slot_rows(BASE, SCALE, OFFSET, offs_s, offs_d, sks, skd, sss, sos, width, in_range, mask_d, KV_BITS)
    if KV_BITS != 0:
        rows = rows.to(Qp.dtype.element_ty)
    return rows


@triton.jit
def _real_after(VALID, b, svalb, svalq, after, Q_LEN, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr):
    """[len(after)] int32: how many real (not padding) new tokens come strictly after each token
    index in ``after`` (-1 counts them all)."""
    if HAS_VALID:
        count = tl.zeros(after.shape, tl.int32)
        for j0 in range(0, Q_LEN, BLOCK):
            offs_j = j0 + tl.arange(0, BLOCK)
            ok = tl.load(VALID + b * svalb + offs_j * svalq, mask=offs_j < Q_LEN, other=0).to(tl.int32) != 0
            count += tl.sum((ok[None, :] & (offs_j[None, :] > after[:, None])).to(tl.int32), axis=1)
    else:
        count = tl.maximum(Q_LEN - 1 - after, 0).to(tl.int32)
    return count


@triton.jit
def _column_sums(p, w):
    """Each key's probability summed over the rows, row r weighted by w[r] (0 for padding)."""
    return tl.sum(p * w[:, None], axis=0)


@triton.jit
def _decay_scores_kernel(
    SCORES, VALID, DECAY_PTR, decay, S, Q_LEN, H,
    ssb, ssh, sss, svalb, svalq, sdecb,
    HAS_VALID: tl.constexpr, DECAY_PER_ROW: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """scores *= decay ** (real new tokens), grid (B * Hkv, cdiv(S, BLOCK_S)): the old-score half of
    the chunk's update, launched before the chunk kernel, whose row blocks then add with atomics."""
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    n_real = _real_after(VALID, b, svalb, svalq, tl.full([1], -1, tl.int32), Q_LEN, HAS_VALID, BLOCK_Q)
    d = row_scalar(DECAY_PTR, decay, b, sdecb, DECAY_PER_ROW).to(tl.float32)
    factor = int_pow(d, n_real)
    offs = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    ptr = SCORES + b * ssb + h * ssh + offs * sss
    tl.store(ptr, tl.load(ptr, mask=offs < S, other=0.0) * factor, mask=offs < S)


@triton.jit
def _chunk_kernel(
    Qp, K, V, SLOT, NK, NV, VALID, SCORES, NEW_SCORES, OUT, DECAY_PTR,
    scale, decay, S, Q_LEN, G, D, H,
    sqb, sqh, sqg, sqq, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    sib, sih, sis,
    snkb, snkh, snkq, snkd,
    snvb, snvh, snvq, snvd,
    svalb, svalq,
    ssb, ssh, sss,
    sob, soh, sog, soq, sod,
    sdecb,
    KS, KO, VS, VO,
    sksb, sksh, skss, skob, skoh, skos, svsb, svsh, svss, svob, svoh, svos,
    key_width, value_width,
    MASKED_LOGIT: tl.constexpr, KV_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_VALID: tl.constexpr, HALF_DOT: tl.constexpr, DECAY: tl.constexpr, DECAY_PER_ROW: tl.constexpr,
):
    bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * Q_LEN
    tok_i = rows // G
    head_g = rows % G
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    q = tl.load(Qp + b * sqb + h * sqh + head_g[:, None] * sqg + tok_i[:, None] * sqq + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & mask_d[None, :], other=0.0)
    if not HALF_DOT:
        q = q.to(tl.float32)
    elif KV_BITS == 0:
        q = q.to(K.dtype.element_ty)
    # (quantised slots with a 16-bit query: the query keeps its dtype, the dequantised rows take it)
    if HAS_VALID:
        row_real = tl.load(VALID + b * svalb + tok_i * svalq, mask=row_ok, other=0).to(tl.int32) != 0
    else:
        row_real = row_ok
    row_real = row_real & row_ok
    # Weight of each row's probabilities in the scores: 0 for padding rows, and with a decay
    # decay ** (real tokens after this one), as if the tokens were fed one at a time.
    if DECAY:
        d = row_scalar(DECAY_PTR, decay, b, sdecb, DECAY_PER_ROW).to(tl.float32)
        later = _real_after(VALID, b, svalb, svalq, tok_i, Q_LEN, HAS_VALID, BLOCK_N)
        row_w = tl.where(row_real, int_pow(d, later), 0.0)
    else:
        row_w = tl.where(row_real, 1.0, 0.0)

    # New-key range this row block can see (causal): keys 0 .. last token of the block.
    last_tok = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, Q_LEN - 1)
    n_end = last_tok + 1

    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    i_base = SLOT + b * sib + h * sih
    nk_base = NK + b * snkb + h * snkh
    nv_base = NV + b * snvb + h * snvh
    ks_base, ko_base = KS + b * sksb + h * sksh, KO + b * skob + h * skoh
    vs_base, vo_base = VS + b * svsb + h * svsh, VO + b * svob + h * svoh

    # ---- pass 1: row max and sum ----
    m_i = tl.full([BLOCK_M], MASKED_LOGIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for s0 in range(0, S, BLOCK_N):
        offs_s = s0 + tl.arange(0, BLOCK_N)
        in_range = offs_s < S
        k = _slot_block(k_base, ks_base, ko_base, offs_s, offs_d, sks, skd, skss, skos, key_width, in_range, mask_d,
                        Qp, KV_BITS)
        tok = tl.load(i_base + offs_s * sis, mask=in_range, other=-1)
        logits = _qk(q, k, HALF_DOT) * scale
        logits = tl.where((tok >= 0)[None, :], logits, MASKED_LOGIT)
        logits = tl.where(in_range[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(logits - m_new[:, None]), axis=1)
        m_i = m_new
    for j0 in range(0, n_end, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        in_range = offs_j < n_end
        k = tl.load(nk_base + offs_j[:, None] * snkq + offs_d[None, :] * snkd,
                    mask=in_range[:, None] & mask_d[None, :], other=0.0)
        if HAS_VALID:
            key_ok = tl.load(VALID + b * svalb + offs_j * svalq, mask=in_range, other=0).to(tl.int32) != 0
        else:
            key_ok = in_range
        logits = _qk(q, k, HALF_DOT) * scale
        allowed = key_ok[None, :] & (offs_j[None, :] <= tok_i[:, None])
        logits = tl.where(allowed, logits, MASKED_LOGIT)
        logits = tl.where(in_range[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(logits - m_new[:, None]), axis=1)
        m_i = m_new

    inv_l = 1.0 / l_i
    # ---- pass 2: normalised probabilities, P @ V, column sums ----
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    s_base = SCORES + b * ssb + h * ssh
    for s0 in range(0, S, BLOCK_N):
        offs_s = s0 + tl.arange(0, BLOCK_N)
        in_range = offs_s < S
        k = _slot_block(k_base, ks_base, ko_base, offs_s, offs_d, sks, skd, skss, skos, key_width, in_range, mask_d,
                        Qp, KV_BITS)
        tok = tl.load(i_base + offs_s * sis, mask=in_range, other=-1)
        logits = _qk(q, k, HALF_DOT) * scale
        logits = tl.where((tok >= 0)[None, :], logits, MASKED_LOGIT)
        logits = tl.where(in_range[None, :], logits, float("-inf"))
        p = tl.exp(logits - m_i[:, None]) * inv_l[:, None]
        v = _slot_block(v_base, vs_base, vo_base, offs_s, offs_d, svs, svd, svss, svos, value_width, in_range,
                        mask_d, Qp, KV_BITS)
        acc += _pv(p, v, HALF_DOT)
        col = _column_sums(p, row_w)
        tl.atomic_add(s_base + offs_s * sss, col, mask=in_range)
    ns_base = NEW_SCORES + bh.to(tl.int64) * Q_LEN
    for j0 in range(0, n_end, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        in_range = offs_j < n_end
        kv_mask = in_range[:, None] & mask_d[None, :]
        k = tl.load(nk_base + offs_j[:, None] * snkq + offs_d[None, :] * snkd, mask=kv_mask, other=0.0)
        if HAS_VALID:
            key_ok = tl.load(VALID + b * svalb + offs_j * svalq, mask=in_range, other=0).to(tl.int32) != 0
        else:
            key_ok = in_range
        logits = _qk(q, k, HALF_DOT) * scale
        allowed = key_ok[None, :] & (offs_j[None, :] <= tok_i[:, None])
        logits = tl.where(allowed, logits, MASKED_LOGIT)
        logits = tl.where(in_range[None, :], logits, float("-inf"))
        p = tl.exp(logits - m_i[:, None]) * inv_l[:, None]
        v = tl.load(nv_base + offs_j[:, None] * snvq + offs_d[None, :] * snvd, mask=kv_mask, other=0.0)
        acc += _pv(p, v, HALF_DOT)
        col = _column_sums(p, row_w)
        tl.atomic_add(ns_base + offs_j, col, mask=in_range)

    tl.store(OUT + b * sob + h * soh + head_g[:, None] * sog + tok_i[:, None] * soq + offs_d[None, :] * sod,
             acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])


def chunk_attend_with_scores(
    query: torch.Tensor,
    cache_keys: torch.Tensor,
    cache_values: torch.Tensor,
    slot_token_index: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    new_valid: torch.Tensor | None,
    scale: float,
    scores: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    decay: float | torch.Tensor = 1.0,
    quant=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.attend_with_scores`` for any Q (see the module docstring), ``decay`` and ``quant``
    included (quantised slots: their codes dequantised as each block is loaded, in both passes; the
    new tokens full precision, in the query's dtype).

    ``block_m`` / ``block_n`` override the tile sizes (>= 16); ``out`` (shape and dtype of the
    result) receives the output instead of a fresh tensor.
    """
    batch, kv_heads, group, q_len, head_dim = query.shape
    slots = cache_keys.shape[2]
    check_quant(quant, query, cache_keys, cache_values)
    for name, t in (("query", query), ("new_keys", new_keys), ("new_values", new_values)) + (
            (("cache_keys", cache_keys), ("cache_values", cache_values)) if quant is None else ()):
        check_float(t, name)
    # the dots take both operands in one dtype: the slots' (and the new tokens'), or the query's
    dot_dtype = cache_keys.dtype if quant is None else query.dtype
    if quant is None and (cache_keys.dtype != new_keys.dtype or cache_values.dtype != new_values.dtype
                          or cache_keys.dtype != cache_values.dtype):
        raise TypeError("cache and new keys/values must share one dtype")
    if quant is not None and (new_keys.dtype != dot_dtype or new_values.dtype != dot_dtype):
        raise TypeError("with quantised slots the new keys and values take the query's dtype")
    if quant is not None and slots == 0:
        quant = None  # no slot to dequantise: the cache loops run zero times over dummy tensors
    if scores.dtype != torch.float32:
        raise TypeError("scores must be float32")
    device = query.device

    if out is None:
        out = torch.empty(batch, kv_heads, group, q_len, head_dim, dtype=query.dtype, device=device)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError("out must have the query's shape and dtype")
    new_scores = torch.zeros(batch, kv_heads, q_len, dtype=torch.float32, device=device)
    if q_len == 0:
        return out, new_scores

    block_d = max(16, next_pow2(head_dim))
    # Tile sizes: 16-bit inputs use ~42 KiB of shared memory at 64 x 64, D = 128; fp32 tiles are
    # twice the bytes and are kept under the ~100 KiB a consumer GPU gives one program.
    num_stages = 3
    if interpreting():
        tile = 16
    elif dot_mode(dot_dtype):
        tile = 64 if block_d <= 128 else 32
    else:
        tile, num_stages = (32 if block_d <= 128 else 16), 2
    block_m = block_m or tile
    block_n = block_n or tile
    rows = group * q_len

    if slots > 0:
        cache_k, cache_v, slot_idx, scores_arg = cache_keys, cache_values, slot_token_index, scores
    else:  # nothing cached: the cache loops run zero times over dummy tensors
        cache_k, cache_v = new_keys, new_values
        slot_idx = torch.full((batch, kv_heads, 1), -1, dtype=torch.int64, device=device)
        scores_arg = new_scores
    if new_valid is not None:
        valid_arg, sval = new_valid, new_valid.stride()
    else:
        valid_arg, sval = new_scores, (0, 0)

    has_decay, decay_per_row, decay_scalar, decay_ptr, sdec = decay_arg(decay, batch, new_scores)

    grid = (batch * kv_heads, triton.cdiv(rows, block_m))
    with launch_guard(query):
        if has_decay and slots > 0:
            block_q = 16 if interpreting() else 128
            _decay_scores_kernel[(batch * kv_heads, triton.cdiv(slots, 1024))](
                scores, valid_arg, decay_ptr, decay_scalar, slots, q_len, kv_heads,
                *scores.stride(), *sval, sdec,
                HAS_VALID=new_valid is not None, DECAY_PER_ROW=decay_per_row, BLOCK_S=1024, BLOCK_Q=block_q,
            )
        _chunk_kernel[grid](
            query, cache_k, cache_v, slot_idx, new_keys, new_values, valid_arg, scores_arg, new_scores, out,
            decay_ptr, float(scale), decay_scalar, slots, q_len, group, head_dim, kv_heads,
            *query.stride(), *cache_k.stride()[:4], *cache_v.stride()[:4], *slot_idx.stride()[:3],
            *new_keys.stride(), *new_values.stride(), *sval, *scores_arg.stride()[:3], *out.stride(), sdec,
            *quant_args(quant, cache_k, cache_v, new_scores),
            MASKED_LOGIT=MASKED, KV_BITS=quant_bits(quant), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            HAS_VALID=new_valid is not None, HALF_DOT=dot_mode(dot_dtype), DECAY=has_decay,
            DECAY_PER_ROW=decay_per_row, num_warps=4, num_stages=num_stages,
        )
    return out, new_scores
