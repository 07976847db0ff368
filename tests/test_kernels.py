"""Triton kernels vs their torch reference: on the CPU through the Triton interpreter, or on a GPU.

Every case draws its random inputs from the ``seed`` fixture (fixed per test: seeds.py; the seed is
in each assertion message, H2OCHAT_TEST_SEED=<seed> replays one, =random fuzzes). Outputs are pre-filled with NaN so a value the kernel never
writes shows up, and the slots of the cache buffer past the scanned view hold NaN so a read past
the view shows up too. Errors are norm-wise relative: |a - b| / |b|.

Where the kernels run: ``H2OCHAT_TEST_DEVICE`` (default ``cpu``). On ``cpu`` the kernels need the
Triton interpreter (conftest.py sets TRITON_INTERPRET=1 before triton's first import); with
``TRITON_INTERPRET=0 H2OCHAT_TEST_DEVICE=cuda`` the same checks run compiled on a GPU (inputs are
drawn on the CPU with the same seed, then moved). Anything else skips these tests with the reason.

The interpreter is ~1000x slower than torch: shapes stay tiny (S <= 40, D <= 80, B <= 2; one case of
2048 slots for the 64-wide GPU tiles), and the tile sizes are the interpreter defaults (16), so
several blocks and splits are still crossed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from h2ochat_kernels import _common, dispatch, reference  # noqa: E402
from h2ochat_kernels import triton_chunk, triton_decode, triton_evict  # noqa: E402
from h2ochat_kernels.triton_chunk import chunk_attend_with_scores  # noqa: E402
from h2ochat_kernels.triton_decode import decode_attend_with_scores, plan_splits  # noqa: E402
from h2ochat_kernels.triton_evict import evict_and_insert as kernel_evict  # noqa: E402
from h2ochat_kernels.triton_evict import evict_by_policy as kernel_evict_by_policy  # noqa: E402

from conftest import triton_interpreter_ready  # noqa: E402

DEVICE = torch.device(os.environ.get("H2OCHAT_TEST_DEVICE", "cpu") or "cpu")


def _why_not_runnable() -> str | None:
    if DEVICE.type == "cpu":
        if not triton_interpreter_ready():
            return ("CPU kernels need the Triton interpreter: TRITON_INTERPRET=1 before triton's first import "
                    "(conftest.py sets it: run through pytest from the repository)")
        return None
    if DEVICE.type == "cuda":
        if _common.interpreting():
            return "H2OCHAT_TEST_DEVICE=cuda runs the compiled kernels: set TRITON_INTERPRET=0"
        if not torch.cuda.is_available():
            return "H2OCHAT_TEST_DEVICE=cuda but torch sees no CUDA device"
        return None
    return f"H2OCHAT_TEST_DEVICE={DEVICE}: the kernels run on cpu (interpreter) or cuda"


runs_kernels = pytest.mark.skipif(_why_not_runnable() is not None, reason=str(_why_not_runnable()))

# Output tolerances, norm-wise relative, against the reference computed in fp32 from the same
# (already rounded) 16-bit inputs. What differs is rounding inside the kernel: the output is
# rounded to its dtype (unit roundoff u = 2^-11 ~ 4.9e-4 for fp16, 2^-8 ~ 3.9e-3 for bf16), and
# with 16-bit dots (fp16 always, bf16 on a GPU) the probabilities are rounded to that dtype
# before P @ V (another ~u per term; the terms' errors are independent, so the norm-wise error
# stays a small multiple of u). fp16 2e-3 ~ 4u, bf16 1e-2 ~ 2.5u: room for both roundings, far below
# what a wrong mask or a missed block gives (> 1e-1). fp32 runs fp32 ("ieee") dots: only summation
# order differs, ~1e-7 per element.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# Scores stay fp32 whatever the model dtype: they come from fp32 logits (products of 16-bit inputs
# are exact in fp32; only the summation order differs from the reference's matmul) and fp32
# softmax, so they are compared at ~1e-5 in every dtype. fp16 gets 1e-4: under the interpreter its
# logits pass through numpy's fp16 dot (the accumulation is exact, the order is not).
SCORE_TOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-5}


def on_device(value):
    """Tensors (also inside lists and dicts) moved to DEVICE; inputs are drawn on the CPU so a seed
    replays the same case on any device."""
    if isinstance(value, torch.Tensor):
        return value.to(DEVICE)
    if isinstance(value, dict):
        return {k: on_device(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v) for v in value)
    return value


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    denom = want.norm().item()
    diff = (got - want).norm().item()
    return diff / denom if denom > 0 else diff


def make_inputs(batch, kv_heads, group, q_len, slots, head_dim, dtype, *, validity="random", padding=False,
                strided=False):
    """Random attention inputs on DEVICE; ``validity``: 'random' | 'all' | 'one'."""
    query = torch.randn(batch, kv_heads, group, q_len, head_dim).to(dtype)
    capacity = slots + 7 if strided else slots
    key_buf = torch.randn(batch, kv_heads, capacity, head_dim).to(dtype)
    val_buf = torch.randn(batch, kv_heads, capacity, head_dim).to(dtype)
    index_buf = torch.arange(capacity).repeat(batch, kv_heads, 1)
    score_buf = torch.rand(batch, kv_heads, capacity)
    if strided:  # the tail past the view must never be read
        key_buf[:, :, slots:] = float("nan")
        val_buf[:, :, slots:] = float("nan")
        score_buf[:, :, slots:] = float("nan")
    if validity == "random":
        index_buf[:, :, :slots][torch.rand(batch, kv_heads, slots) < 0.3] = -1
    elif validity == "one":
        index_buf[:, :, :slots] = -1
        pick = torch.randint(0, slots, (batch, kv_heads, 1))
        index_buf[:, :, :slots].scatter_(2, pick, 5)
    new_keys = torch.randn(batch, kv_heads, q_len, head_dim).to(dtype)
    new_values = torch.randn(batch, kv_heads, q_len, head_dim).to(dtype)
    new_valid = None
    if padding:  # left padding on sequence 0 (first token(s) padding), one more padding row on the last
        new_valid = torch.ones(batch, q_len, dtype=torch.bool)
        new_valid[0, : max(1, q_len // 2)] = False
        if batch > 1 and q_len > 1:
            new_valid[-1, -1] = False
    key_buf, val_buf, index_buf, score_buf = on_device((key_buf, val_buf, index_buf, score_buf))
    inputs = dict(query=query, cache_keys=key_buf[:, :, :slots], cache_values=val_buf[:, :, :slots],
                  slot_token_index=index_buf[:, :, :slots], new_keys=new_keys, new_values=new_values,
                  new_valid=new_valid, scale=head_dim ** -0.5, scores=score_buf[:, :, :slots])
    return {k: (v if k in ("cache_keys", "cache_values", "slot_token_index", "scores") else on_device(v))
            for k, v in inputs.items()}, score_buf


def check_attention(kernel, inputs, seed, decay=1.0, **kwargs):
    dtype = inputs["query"].dtype
    as_float = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
    ref_scores = inputs["scores"].clone()
    as_float["scores"] = ref_scores
    want_out, want_new = reference.attend_with_scores(**as_float, decay=decay)

    before = inputs["scores"].clone()
    out = torch.full_like(inputs["query"], float("nan"))
    got_out, got_new = kernel(**inputs, out=out, decay=decay, **kwargs)
    assert got_out is out

    msg = (f"seed={seed} dtype={dtype} shape={tuple(inputs['query'].shape)} S={inputs['cache_keys'].shape[2]} "
           f"decay={decay}")
    assert inputs["scores"].dtype == got_new.dtype == torch.float32, msg
    new_valid = inputs["new_valid"]
    if new_valid is not None:  # padding rows: any finite output
        real = new_valid.view(new_valid.shape[0], 1, 1, -1, 1)
        assert torch.isfinite(got_out.float()).all(), msg
        got_out, want_out = got_out * real, want_out.float() * real
    assert torch.isfinite(got_out.float()).all(), msg
    assert rel_err(got_out, want_out.to(dtype)) < TOL[dtype], (msg, rel_err(got_out, want_out.to(dtype)))
    assert rel_err(inputs["scores"] - before, ref_scores - before) < SCORE_TOL[dtype], msg
    assert rel_err(got_new, want_new) < SCORE_TOL[dtype], msg
    if new_valid is not None:
        pad = ~new_valid
        assert (got_new.permute(0, 2, 1)[pad] == 0).all(), msg
        if new_valid.shape[1] == 1:  # a padding token leaves its sequence's scores exactly as they were
            assert torch.equal(inputs["scores"][pad[:, 0]], before[pad[:, 0]]), msg


DECODE_CASES = [
    # dtype, B, Hkv, G, S, D, validity, padding, strided, num_splits
    pytest.param(torch.float32, 2, 2, 4, 37, 64, "random", False, True, None, id="fp32-G4-D64-S37-strided-splits"),
    pytest.param(torch.float32, 1, 2, 1, 19, 80, "all", False, False, 1, id="fp32-G1-D80-allvalid-1split"),
    pytest.param(torch.float32, 2, 1, 8, 33, 64, "one", True, False, None, id="fp32-G8-oneslot-padding"),
    pytest.param(torch.float16, 2, 2, 8, 40, 80, "random", True, True, 2, id="fp16-G8-D80-padding-strided"),
    pytest.param(torch.float16, 1, 1, 3, 5, 64, "all", False, False, None, id="fp16-G3-S5"),
    pytest.param(torch.bfloat16, 2, 1, 2, 29, 80, "random", True, False, None, id="bf16-G2-D80-padding"),
]


@runs_kernels
@pytest.mark.parametrize("dtype,batch,kv_heads,group,slots,head_dim,validity,padding,strided,num_splits", DECODE_CASES)
def test_decode_matches_reference(dtype, batch, kv_heads, group, slots, head_dim, validity, padding, strided, num_splits, seed):
    inputs, _ = make_inputs(batch, kv_heads, group, 1, slots, head_dim, dtype, validity=validity,
                            padding=padding, strided=strided)
    check_attention(decode_attend_with_scores, inputs, seed, num_splits=num_splits)


@runs_kernels
def test_decode_empty_cache_and_no_scoring(seed):
    inputs, _ = make_inputs(1, 2, 4, 1, 0, 64, torch.float32)
    check_attention(decode_attend_with_scores, inputs, seed)
    # score=False: same output, scores untouched
    inputs, _ = make_inputs(1, 1, 4, 1, 21, 64, torch.float32)
    want, _ = reference.attend_with_scores(**{**inputs, "scores": inputs["scores"].clone()})
    before = inputs["scores"].clone()
    got, _ = decode_attend_with_scores(**inputs, score=False)
    assert rel_err(got, want) < 1e-5, f"seed={seed}"
    assert torch.equal(inputs["scores"], before)


CHUNK_CASES = [
    # dtype, B, Hkv, G, Q, S, D, validity, padding, strided
    pytest.param(torch.float32, 2, 2, 4, 5, 37, 64, "random", True, True, id="fp32-G4-Q5-padding-strided"),
    pytest.param(torch.float32, 1, 1, 8, 3, 17, 80, "all", False, False, id="fp32-G8-D80-allvalid"),
    pytest.param(torch.float32, 2, 1, 1, 9, 21, 64, "one", True, False, id="fp32-G1-Q9-oneslot-padding"),
    pytest.param(torch.float16, 1, 2, 2, 6, 30, 80, "random", False, True, id="fp16-G2-D80-strided"),
    pytest.param(torch.bfloat16, 2, 1, 4, 4, 13, 64, "random", True, False, id="bf16-G4-padding"),
    pytest.param(torch.float32, 1, 2, 2, 7, 0, 64, "all", True, False, id="fp32-emptycache"),
]


@runs_kernels
@pytest.mark.parametrize("dtype,batch,kv_heads,group,q_len,slots,head_dim,validity,padding,strided", CHUNK_CASES)
def test_chunk_matches_reference(dtype, batch, kv_heads, group, q_len, slots, head_dim, validity, padding, strided, seed):
    inputs, _ = make_inputs(batch, kv_heads, group, q_len, slots, head_dim, dtype, validity=validity,
                            padding=padding, strided=strided)
    check_attention(chunk_attend_with_scores, inputs, seed)


@runs_kernels
def test_chunk_single_token_equals_decode(seed):
    """The chunk kernel also takes Q == 1; both kernels must agree with each other."""
    inputs, _ = make_inputs(1, 2, 4, 1, 23, 64, torch.float32, padding=False)
    check_attention(chunk_attend_with_scores, inputs, seed)


def draw_decay(kind, batch):
    """A float, or per sequence: 'rows' = [B] with an exact 0 in the first row, 'one' = a [1] tensor."""
    if kind == "rows":
        decay = torch.rand(batch) * 0.9 + 0.05
        decay[0] = 0.0
        return on_device(decay)
    if kind == "one":
        return on_device(torch.rand(1) * 0.9 + 0.05)
    return kind


DECAY_CASES = [
    # q_len, decay, padding, dtype. Padding on sequence 0: its first half (its only token at Q == 1)
    # and the last sequence's last token, so decay ** (real rows after) skips padding rows.
    pytest.param(1, 0.0, True, torch.float32, id="Q1-decay0-padding"),
    pytest.param(1, 0.5, False, torch.float32, id="Q1-decay0.5"),
    pytest.param(1, 1.0, True, torch.float32, id="Q1-decay1-padding"),
    pytest.param(1, "rows", True, torch.float16, id="Q1-perrow-padding-fp16"),
    pytest.param(1, "rows", False, torch.bfloat16, id="Q1-perrow-bf16"),
    pytest.param(6, 0.0, True, torch.float32, id="Q6-decay0-padding"),
    pytest.param(6, 0.0, False, torch.float32, id="Q6-decay0"),
    pytest.param(6, 0.5, False, torch.float32, id="Q6-decay0.5"),
    pytest.param(6, 1.0, True, torch.float32, id="Q6-decay1-padding"),
    pytest.param(6, "rows", True, torch.bfloat16, id="Q6-perrow-padding-bf16"),
    pytest.param(6, "rows", False, torch.float16, id="Q6-perrow-fp16"),
    pytest.param(5, "one", True, torch.float32, id="Q5-onevalue-tensor-padding"),
]


@runs_kernels
@pytest.mark.parametrize("q_len,decay,padding,dtype", DECAY_CASES)
def test_decay_matches_reference(q_len, decay, padding, dtype, seed):
    """S <- decay * S + a_t per real token: decode (Q == 1) and chunk kernels, strided score views."""
    inputs, _ = make_inputs(2, 2, 2, q_len, 21, 32, dtype, padding=padding, strided=True)
    decay = draw_decay(decay, 2)
    kernel = decode_attend_with_scores if q_len == 1 else chunk_attend_with_scores
    check_attention(kernel, inputs, seed, decay=decay)


@runs_kernels
def test_decay_with_empty_cache(seed):
    """Nothing cached: only the new tokens' scores, weighted by decay ** (real rows after)."""
    inputs, _ = make_inputs(2, 1, 2, 5, 0, 32, torch.float32, padding=True)
    check_attention(chunk_attend_with_scores, inputs, seed, decay=draw_decay("rows", 2))


@runs_kernels
def test_scores_must_be_fp32():
    """Scores are fp32 whatever the model dtype: the kernels refuse anything else, and dispatch sends
    such a call to the reference instead of a kernel."""
    inputs, _ = make_inputs(1, 1, 2, 3, 8, 32, torch.bfloat16)
    inputs["scores"] = inputs["scores"].to(torch.bfloat16)
    with pytest.raises(TypeError):
        chunk_attend_with_scores(**inputs)
    assert not dispatch._attention_supported(inputs["query"], inputs["cache_keys"], inputs["cache_values"],
                                             inputs["new_keys"], inputs["new_values"], inputs["scores"])


# ------------------------------------------------------------------------------------- 64-wide tiles
def test_split_planner_gpu_branch(monkeypatch):
    """The planner's GPU branch (no device needed: the SM count is faked as an H100/H200's 132)."""
    assert plan_splits(1, 2048, 16, torch.device("cpu"))[0] == 32  # CPU: 4 x 8 programs, no floor, no cap
    monkeypatch.setattr(triton_decode, "_sm_count", lambda device: 132)
    gpu = torch.device("cuda")
    for bh in (1, 4, 8, 64, 512):
        for slots in (1, 63, 64, 65, 2048, 4096, 16384, 100_000):
            splits, split_len = plan_splits(bh, slots, 64, gpu)
            blocks = -(-slots // 64)
            where = f"bh={bh} slots={slots}: {splits} x {split_len}"
            assert split_len % 64 == 0 and 1 <= splits <= 32, where
            assert (splits - 1) * split_len < slots <= splits * split_len, where  # no empty split, all covered
            assert split_len >= 4 * 64 or splits == 1, where  # no split shorter than 4 blocks
            if bh >= 4 * 132:
                assert splits == 1, where  # enough programs without splitting
    assert plan_splits(512, 4096, 64, gpu) == (2, 2048)
    assert plan_splits(1, 16384, 64, gpu) == (32, 512)  # a lone sequence: at most 32 splits
    assert plan_splits(1, 2048, 64, gpu) == (8, 256)
    assert plan_splits(1, 9 * 64, 64, gpu) == (2, 320)  # 9 blocks: 2 splits of 5, not 3 of 3


@runs_kernels
def test_gpu_tiles_over_thousands_of_slots(monkeypatch, seed):
    """The 64-wide tiles a GPU uses (block_s / block_m / block_n 64) over 2048 slots, with the split
    count the GPU planner picks for one sequence, and the eviction's two 1024-slot blocks."""
    monkeypatch.setattr(triton_decode, "_sm_count", lambda device: 132)
    splits, _ = plan_splits(1, 2048, 64, torch.device("cuda"))
    inputs, _ = make_inputs(1, 1, 2, 1, 2048, 16, torch.float32, padding=False)
    check_attention(decode_attend_with_scores, inputs, seed, decay=0.5, block_s=64, num_splits=splits)
    inputs, _ = make_inputs(1, 1, 2, 40, 2048, 16, torch.float32, padding=True)  # 80 rows: two row blocks
    check_attention(chunk_attend_with_scores, inputs, seed, decay=0.9, block_m=64, block_n=64)
    check_policy_eviction(seed, 1, 1, 2048, 16, torch.float32, dict(recent=8, sinks=4), ties=True)


# ------------------------------------------------------------------------------------------ eviction
def make_evict_inputs(batch, kv_heads, slots, head_dim, dtype, ties, value_norm=False):
    if ties:  # few distinct values, whole rows of +inf (all protected) and -inf (empty slots)
        priority = torch.randint(0, 3, (batch, kv_heads, slots)).float()
        priority[0, 0] = float("inf")
        priority[-1, -1, slots // 2:] = float("-inf")
    else:
        priority = torch.randn(batch, kv_heads, slots)
        priority[:, :, -3:] = float("inf")  # the recent window
    state = [
        priority,
        torch.randn(batch, kv_heads, slots, head_dim).to(dtype),
        torch.randn(batch, kv_heads, slots, head_dim).to(dtype),
        torch.rand(batch, kv_heads, slots),
        torch.randint(-1, 1000, (batch, kv_heads, slots)),
        torch.randint(0, 1000, (batch, kv_heads, slots)),
    ]
    new = [
        torch.randn(batch, kv_heads, 1, head_dim).to(dtype),
        torch.randn(batch, kv_heads, 1, head_dim).to(dtype),
        torch.rand(batch, kv_heads),
        torch.randint(0, 1000, (batch,)),
        torch.randint(0, 1000, (batch,)),
    ]
    if value_norm:
        state.append(torch.rand(batch, kv_heads, slots))
        new.append(torch.rand(batch, kv_heads))
    return on_device(state), on_device(new)


@pytest.mark.parametrize("dtype,slots,head_dim,ties,block_s,value_norm", [
    pytest.param(torch.float32, 37, 80, False, None, False, id="fp32-S37-D80"),
    pytest.param(torch.bfloat16, 40, 64, True, 16, True, id="bf16-ties-valuenorm"),
    pytest.param(torch.float16, 21, 64, True, 16, False, id="fp16-ties"),
])
@runs_kernels
def test_evict_matches_reference(dtype, slots, head_dim, ties, block_s, value_norm, seed):
    state, new = make_evict_inputs(2, 3, slots, head_dim, dtype, ties, value_norm)
    mine = [t.clone() for t in state]
    want = reference.evict_and_insert(*state[:6], *new[:5], *state[6:], *new[5:])
    got = kernel_evict(*mine[:6], *new[:5], *mine[6:], *new[5:], block_s=block_s)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), f"seed={seed}"
    for a, b in zip(mine, state):
        assert torch.equal(a, b), f"seed={seed}"


@runs_kernels
def test_evict_strided_buffers(seed):
    """Slot tensors that are views of a larger buffer (the cache may scan fewer slots than it holds)."""
    state, new = make_evict_inputs(1, 2, 30, 64, torch.float32, ties=False)
    big = [torch.cat([t, t[:, :, :5]], dim=2) for t in state]
    views = [t[:, :, :30] for t in big]
    copies = [t.clone() for t in big]
    want = reference.evict_and_insert(*[t[:, :, :30] for t in copies], *new)
    got = kernel_evict(*views, *new)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), f"seed={seed}"
    for a, b in zip(big, copies):
        assert torch.equal(a, b), f"seed={seed}"


def make_policy_state(batch, kv_heads, slots, head_dim, dtype, *, ties, recent=4, sinks=2, spare=0):
    """A cache as the app holds it: distinct token indices below the newest token, fp32 scores and
    value norms (few distinct values when ``ties``), K/V in ``dtype``; ``spare`` slots past the view
    hold junk that must stay untouched.

    Every row is one of: (a) plain random ranks, (b) the same with two empty slots (-1, must go
    first), (c) the tokens on both sides of each protection edge present: sinks - 1 and
    newest - recent + 1 (protected) get the lowest score, -1, and sinks and newest - recent (not
    protected) score 0, so an off-by-one at either edge picks a different slot, and the two 0s tie.
    """
    newest = torch.randint(slots + 10, 3 * slots + 20, (batch,))
    recent_b = recent.tolist() if isinstance(recent, torch.Tensor) else [recent] * batch
    sinks_b = sinks.tolist() if isinstance(sinks, torch.Tensor) else [sinks] * batch
    cap = slots + spare
    index = torch.empty(batch, kv_heads, cap, dtype=torch.int64)
    if ties:  # integer scores: 1/3 and 2/6 tie by age too
        scores = torch.randint(1, 5, (batch, kv_heads, cap)).float()
        norms = torch.randint(1, 3, (batch, kv_heads, cap)).float()
    else:
        scores, norms = torch.rand(batch, kv_heads, cap) * 4 + 1, torch.rand(batch, kv_heads, cap) + 0.5
    for b in range(batch):
        n, edge_r, edge_s = int(newest[b]), int(newest[b]) - recent_b[b], sinks_b[b]
        edges = {t: score for t, score in ((edge_s - 1, -1.0), (edge_s, 0.0), (edge_r + 1, -1.0), (edge_r, 0.0))
                 if 0 <= t < n}
        for h in range(kv_heads):
            kind = torch.randint(0, 3, ()).item()
            if kind == 2:
                others = torch.tensor([t for t in torch.randperm(n)[:cap + 4].tolist() if t not in edges])
                row = torch.cat([torch.tensor(list(edges), dtype=torch.int64), others])[:cap]
                row = row[torch.randperm(cap)]
                for t, score in edges.items():
                    scores[b, h][row == t] = score
            else:
                row = torch.randperm(n)[:cap]
                if kind == 1:
                    row[torch.randperm(slots)[:2]] = -1
            index[b, h] = row
    kv = [torch.randn(batch, kv_heads, cap, head_dim).to(dtype) for _ in range(2)]
    state = [*kv, scores, index, torch.randint(0, 4096, (batch, kv_heads, cap)), norms]
    new_kv = [torch.randn(batch, kv_heads, 1, head_dim).to(dtype) for _ in range(2)]
    new = [*new_kv, torch.rand(batch, kv_heads), newest, newest + 3, torch.rand(batch, kv_heads) + 0.5]
    return on_device(state), on_device(new)


def check_policy_eviction(seed, batch, kv_heads, slots, head_dim, dtype, policy, *, ties, spare=0,
                          all_protected_row=False, value_norm=True, block_s=None):
    state, new = make_policy_state(batch, kv_heads, slots, head_dim, dtype, ties=ties, spare=spare,
                                   recent=policy["recent"], sinks=policy["sinks"])
    if all_protected_row:  # sequence 0, head 0: every slot full and inside the recent window -> slot 0
        state[3][0, 0] = torch.randperm(int(new[3][0]))[:slots + spare].to(DEVICE)
    if not value_norm:
        state, new = state[:5], new[:5]
    policy = {k: on_device(v) for k, v in policy.items()}
    mine, ref = [t.clone() for t in state], [t.clone() for t in state]
    want = reference.evict_by_policy(*[t[:, :, :slots] for t in ref[:5]], *new[:5], *[t[:, :, :slots] for t in ref[5:]],
                                     *new[5:], **policy)
    got = kernel_evict_by_policy(*[t[:, :, :slots] for t in mine[:5]], *new[:5],
                                 *[t[:, :, :slots] for t in mine[5:]], *new[5:], **policy, block_s=block_s)
    msg = f"seed={seed} policy={policy} dtype={dtype} S={slots}"
    assert all(torch.equal(g, w) for g, w in zip(got, want)), (msg, got, want)
    for a, b in zip(mine, ref):
        assert torch.equal(a, b), msg
    if all_protected_row:  # argmin of all +inf: slot 0
        assert ref[3][0, 0, 0] == new[3][0], msg


def per_seq(*values):
    return torch.tensor(values)


POLICY_CASES = [
    # policy, dtype, ties, all_protected_row, value_norm
    pytest.param(dict(recent=4, sinks=2), torch.float32, True, False, False, id="h2o-ties"),
    pytest.param(dict(recent=per_seq(100_000, 3), sinks=per_seq(0, 5)), torch.float32, True, True, True,
                 id="perrow-window-allprotected"),
    pytest.param(dict(recent=3, sinks=per_seq(4, 1), by_age=True), torch.bfloat16, True, False, True,
                 id="byage-ties-bf16"),
    pytest.param(dict(recent=per_seq(2, 6), sinks=0, by_age=True, value_eps=0.25), torch.float16, False, False, True,
                 id="byage-valueeps-fp16"),
    pytest.param(dict(recent=5, sinks=3, value_eps=0.0), torch.float32, True, False, True, id="valueeps0-ties"),
    pytest.param(dict(recent=per_seq(1, 4), sinks=2, oldest_first=True, by_age=True, value_eps=1.0), torch.float32,
                 False, False, True, id="oldestfirst"),
]


@runs_kernels
@pytest.mark.parametrize("policy,dtype,ties,all_protected_row,value_norm", POLICY_CASES)
def test_evict_by_policy_matches_reference(policy, dtype, ties, all_protected_row, value_norm, seed):
    """Fused priority (rank, age, value norm, recent window, sinks, empty slots) + argmin + write,
    on strided views (5 junk slots past the view), the argmin crossing 16-slot blocks."""
    check_policy_eviction(seed, 2, 3, 37, 32, dtype, policy, ties=ties, spare=5,
                          all_protected_row=all_protected_row, value_norm=value_norm, block_s=16)


@runs_kernels
def test_evict_by_policy_empty_slots_go_first(seed):
    """Half the slots empty: an empty slot is always the one overwritten (dropped = -1)."""
    state, new = make_policy_state(2, 2, 24, 16, torch.float32, ties=False, recent=2, sinks=1)
    mine, ref = [t.clone() for t in state], [t.clone() for t in state]
    mine[3][:, :, ::2] = ref[3][:, :, ::2] = -1
    want = reference.evict_by_policy(*ref[:5], *new[:5], recent=2, sinks=1)
    got = kernel_evict_by_policy(*mine[:5], *new[:5], recent=2, sinks=1)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), f"seed={seed}"
    assert (got[0] == -1).all(), f"seed={seed}"
    for a, b in zip(mine, ref):
        assert torch.equal(a, b), f"seed={seed}"


@runs_kernels
@pytest.mark.parametrize("fused", [True, False], ids=["evict_by_policy", "evict_and_insert"])
def test_eviction_leaves_rows_that_are_not_active_alone(fused, seed):
    """An ``active`` mask: the rows left out keep every slot bit for bit and report nothing dropped
    (-1, score 0); the active rows get exactly the unmasked eviction. The kernel against the
    reference, the reference against the unmasked call."""
    policy = dict(recent=3, sinks=1, by_age=True, value_eps=0.5)
    state, new = make_policy_state(3, 2, 29, 32, torch.bfloat16, ties=True, recent=3, sinks=1)
    active = on_device(torch.tensor([False, True, False]))
    kept, plain, mine = ([t.clone() for t in state] for _ in range(3))
    if fused:
        def evict(fn, s, mask):
            return fn(*s[:5], *new[:5], s[5], new[5], mask, **policy)
        reference_fn, kernel_fn = reference.evict_by_policy, kernel_evict_by_policy
    else:
        priority = reference.keep_priority(reference.slot_rank(state[2], state[3], new[3], state[5], by_age=True,
                                                               value_eps=0.5), state[3], new[3], 3, 1)

        def evict(fn, s, mask):
            return fn(priority, *s[:5], *new[:5], s[5], new[5], mask)
        reference_fn, kernel_fn = reference.evict_and_insert, kernel_evict
    want = evict(reference_fn, kept, active)
    unmasked = evict(reference_fn, plain, None)
    got = evict(kernel_fn, mine, active)
    msg = f"seed={seed}"
    assert all(torch.equal(g, w) for g, w in zip(got, want)), msg
    assert all(torch.equal(a, b) for a, b in zip(mine, kept)), msg
    left_out, rows = ~active, active
    assert (want[0][left_out] == -1).all() and (want[1][left_out] == 0).all(), msg
    assert torch.equal(want[0][rows], unmasked[0][rows]) and torch.equal(want[1][rows], unmasked[1][rows]), msg
    for a, b, original in zip(kept, plain, state):
        assert torch.equal(a[left_out], original[left_out]), msg
        assert torch.equal(a[rows], b[rows]), msg
    assert not torch.equal(kept[3][rows], state[3][rows]), f"{msg}: nothing was written"


@runs_kernels
@pytest.mark.parametrize("by_age,dropped", [(True, 4), (False, 9)])
def test_evict_by_policy_age_rank_by_hand(by_age, dropped):
    """A worked case: newest token 10, slots hold tokens 4, 7, 9, 1 (ages 7, 4, 2, 10) with scores
    3.5, 2, 1.1, 5.2. By score the 1.1 goes (token 9); by score / age 3.5/7 and 2/4 tie at exactly
    0.5, the lowest slot wins (token 4); one step off in the age (6, 3, 1, 9) would drop token 1."""
    slots, dim = 4, 16
    state = [torch.zeros(1, 1, slots, dim), torch.zeros(1, 1, slots, dim), torch.tensor([[[3.5, 2.0, 1.1, 5.2]]]),
             torch.tensor([[[4, 7, 9, 1]]]), torch.tensor([[[4, 7, 9, 1]]])]
    new = [torch.ones(1, 1, 1, dim), torch.ones(1, 1, 1, dim), torch.tensor([[0.25]]), torch.tensor([10]),
           torch.tensor([10])]
    state, new = on_device(state), on_device(new)
    mine = [t.clone() for t in state]
    want = reference.evict_by_policy(*state, *new, recent=0, sinks=0, by_age=by_age)
    got = kernel_evict_by_policy(*mine, *new, recent=0, sinks=0, by_age=by_age)
    assert want[0].item() == got[0].item() == dropped
    assert all(torch.equal(a, b) for a, b in zip(mine, state))


# ------------------------------------------------------------------------------------------ dispatch
@runs_kernels
def test_dispatch_honours_env(monkeypatch, seed):
    import h2ochat_kernels

    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(triton_decode, "decode_attend_with_scores", spy("decode", triton_decode.decode_attend_with_scores))
    monkeypatch.setattr(triton_chunk, "chunk_attend_with_scores", spy("chunk", triton_chunk.chunk_attend_with_scores))
    monkeypatch.setattr(triton_evict, "evict_and_insert", spy("evict", triton_evict.evict_and_insert))
    monkeypatch.setattr(triton_evict, "evict_by_policy", spy("policy", triton_evict.evict_by_policy))

    def run_all():
        for q_len, decay in ((1, 0.5), (3, draw_decay("rows", 1))):
            inputs, _ = make_inputs(1, 1, 2, q_len, 18, 64, torch.float32)
            ref_scores = inputs["scores"].clone()
            want, _ = reference.attend_with_scores(**{**inputs, "scores": ref_scores}, decay=decay)
            got, _ = h2ochat_kernels.attend_with_scores(**inputs, decay=decay)
            assert rel_err(got, want) < 1e-5, f"seed={seed}"
            assert rel_err(inputs["scores"], ref_scores) < 1e-5, f"seed={seed}"
        state, new = make_evict_inputs(1, 2, 20, 64, torch.float32, ties=False)
        h2ochat_kernels.evict_and_insert(*state, *new)
        state, new = make_policy_state(1, 2, 20, 16, torch.float32, ties=False, recent=per_seq(3), sinks=1)
        h2ochat_kernels.evict_by_policy(*state[:5], *new[:5], recent=on_device(per_seq(3)), sinks=1, by_age=True)

    monkeypatch.setenv("H2OCHAT_KERNELS", "torch")
    assert h2ochat_kernels.kernel_backend(DEVICE) == "torch"
    run_all()
    assert calls == []

    monkeypatch.setenv("H2OCHAT_KERNELS", "triton")
    assert h2ochat_kernels.kernel_backend(DEVICE) == "triton"
    run_all()
    assert calls == ["decode", "chunk", "evict", "policy"]

    calls.clear()
    monkeypatch.setenv("H2OCHAT_KERNELS", "auto")  # CPU tensors: torch; CUDA tensors: triton
    want_calls = [] if DEVICE.type == "cpu" else ["decode", "chunk", "evict", "policy"]
    assert h2ochat_kernels.kernel_backend(DEVICE) == ("torch" if DEVICE.type == "cpu" else "triton")
    run_all()
    assert calls == want_calls
    monkeypatch.delenv("H2OCHAT_KERNELS")
    assert h2ochat_kernels.kernel_backend("cpu") == "torch"
    assert dispatch.kernel_backend(torch.device("cuda")) == "triton"  # auto + CUDA + triton importable

    monkeypatch.setenv("H2OCHAT_KERNELS", "fastest")
    with pytest.raises(ValueError):
        h2ochat_kernels.kernel_backend("cpu")

    monkeypatch.setenv("H2OCHAT_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        h2ochat_kernels.kernel_backend("cpu")


# ------------------------------------------------------------------------------------- device guard
def test_every_launch_is_guarded_with_the_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device and stream: each wrapper must make the device of the
    tensors it was given current around its launches (layers on cuda:1 under device_map auto).

    No GPU needed: the tensors are fake ones on cuda:1 (torch's FakeTensorMode: shapes, strides and a
    device, no data), ``torch.cuda.device`` (the guard ``_common.launch_guard`` takes) is replaced by
    a recorder, and every kernel by a fake launcher that notes which device was current."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    current = ["cuda:0"]
    launches = []

    class RecordingGuard:
        def __init__(self, device):
            self.device = str(torch.device(device))

        def __enter__(self):
            self.previous, current[0] = current[0], self.device

        def __exit__(self, *exc):
            current[0] = self.previous

    class FakeKernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, current[0]))

    monkeypatch.setattr(torch.cuda, "device", RecordingGuard)
    monkeypatch.setattr(triton_decode, "_sm_count", lambda device: 132)
    for module, name in ((triton_decode, "_decode_split_kernel"), (triton_decode, "_decode_combine_kernel"),
                         (triton_chunk, "_decay_scores_kernel"), (triton_chunk, "_chunk_kernel"),
                         (triton_evict, "_evict_kernel")):
        monkeypatch.setattr(module, name, FakeKernel(name))

    with FakeTensorMode():
        def attention(q_len):
            dev = torch.device("cuda:1")
            return dict(
                query=torch.empty(2, 2, 4, q_len, 16, device=dev), cache_keys=torch.empty(2, 2, 64, 16, device=dev),
                cache_values=torch.empty(2, 2, 64, 16, device=dev),
                slot_token_index=torch.empty(2, 2, 64, dtype=torch.int64, device=dev),
                new_keys=torch.empty(2, 2, q_len, 16, device=dev), new_values=torch.empty(2, 2, q_len, 16, device=dev),
                new_valid=torch.ones(2, q_len, dtype=torch.bool, device=dev), scale=0.25,
                scores=torch.empty(2, 2, 64, device=dev),
            )

        decay = torch.full((2,), 0.5, device="cuda:1")
        decode_attend_with_scores(**attention(1), decay=decay)
        chunk_attend_with_scores(**attention(5), decay=decay)
        dev = torch.device("cuda:1")
        state = [torch.empty(2, 2, 64, 16, device=dev), torch.empty(2, 2, 64, 16, device=dev),
                 torch.empty(2, 2, 64, device=dev), torch.empty(2, 2, 64, dtype=torch.int64, device=dev),
                 torch.empty(2, 2, 64, dtype=torch.int64, device=dev)]
        new = [torch.empty(2, 2, 1, 16, device=dev), torch.empty(2, 2, 1, 16, device=dev),
               torch.empty(2, 2, device=dev), torch.zeros(2, dtype=torch.int64, device=dev),
               torch.zeros(2, dtype=torch.int64, device=dev)]
        kernel_evict(torch.empty(2, 2, 64, device=dev), *state, *new)
        kernel_evict_by_policy(*state, *new, recent=4, sinks=torch.ones(2, dtype=torch.int64, device=dev))

    assert launches == [
        ("_decode_split_kernel", "cuda:1"), ("_decode_combine_kernel", "cuda:1"),
        ("_decay_scores_kernel", "cuda:1"), ("_chunk_kernel", "cuda:1"),
        ("_evict_kernel", "cuda:1"), ("_evict_kernel", "cuda:1"),
    ]
    assert current == ["cuda:0"]  # the previous device is current again after each call
    assert isinstance(_common.launch_guard(torch.empty(1)), contextlib.nullcontext)  # CPU: no guard


def test_import_without_triton():
    """Importing the package and the torch path must work where triton cannot be imported."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import os, torch\n"
        "import h2ochat_kernels as k\n"
        "assert k.kernel_backend('cpu') == 'torch'\n"
        "assert k.kernel_backend('cuda') == 'torch'\n"
        "os.environ['H2OCHAT_KERNELS'] = 'triton'\n"
        "try:\n"
        "    k.kernel_backend('cuda')\n"
        "except RuntimeError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("H2OCHAT_KERNELS", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
