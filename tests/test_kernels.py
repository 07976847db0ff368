"""Triton kernels vs their torch reference, on the CPU through the Triton interpreter.

Every case draws fresh random inputs; the seed is in each assertion message (set
H2OCHAT_TEST_SEED=<seed> to replay one). Outputs are pre-filled with NaN so a value the kernel never
writes shows up, and the slots of the cache buffer past the scanned view hold NaN so a read past
the view shows up too. Errors are norm-wise relative: |a - b| / |b|.

The interpreter is ~1000x slower than torch: shapes stay tiny (S <= 40, D <= 80, B <= 2), and the
tile sizes are the interpreter defaults (16), so several blocks and splits are still crossed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from h2ochat_kernels import dispatch, reference  # noqa: E402
from h2ochat_kernels.triton_chunk import chunk_attend_with_scores  # noqa: E402
from h2ochat_kernels.triton_decode import decode_attend_with_scores  # noqa: E402
from h2ochat_kernels.triton_evict import evict_and_insert as triton_evict  # noqa: E402

from conftest import triton_interpreter_ready  # noqa: E402

in_process = pytest.mark.skipif(not triton_interpreter_ready(), reason="triton was imported before TRITON_INTERPRET=1 "
                                "(conftest.py sets it first: run through pytest from the repository)")


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SCORE_TOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-5}


def fresh_seed() -> int:
    seed = int(os.environ.get("H2OCHAT_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    denom = want.norm().item()
    diff = (got - want).norm().item()
    return diff / denom if denom > 0 else diff


def make_inputs(batch, kv_heads, group, q_len, slots, head_dim, dtype, *, validity="random", padding=False,
                strided=False):
    """Random attention inputs; ``validity``: 'random' | 'all' | 'one'."""
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
    keys, values = key_buf[:, :, :slots], val_buf[:, :, :slots]
    index, scores = index_buf[:, :, :slots], score_buf[:, :, :slots]
    if validity == "random":
        index[torch.rand(batch, kv_heads, slots) < 0.3] = -1
    elif validity == "one":
        index.fill_(-1)
        pick = torch.randint(0, slots, (batch, kv_heads, 1))
        index.scatter_(2, pick, 5)
    new_keys = torch.randn(batch, kv_heads, q_len, head_dim).to(dtype)
    new_values = torch.randn(batch, kv_heads, q_len, head_dim).to(dtype)
    new_valid = None
    if padding:  # left padding on sequence 0 (first token(s) padding), one more padding row on the last
        new_valid = torch.ones(batch, q_len, dtype=torch.bool)
        new_valid[0, : max(1, q_len // 2)] = False
        if batch > 1 and q_len > 1:
            new_valid[-1, -1] = False
    return dict(query=query, cache_keys=keys, cache_values=values, slot_token_index=index,
                new_keys=new_keys, new_values=new_values, new_valid=new_valid,
                scale=head_dim ** -0.5, scores=scores), score_buf


def check_attention(kernel, inputs, seed, **kwargs):
    dtype = inputs["query"].dtype
    as_float = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
    ref_scores = inputs["scores"].clone()
    as_float["scores"] = ref_scores
    want_out, want_new = reference.attend_with_scores(**as_float)

    before = inputs["scores"].clone()
    out = torch.full_like(inputs["query"], float("nan"))
    got_out, got_new = kernel(**inputs, out=out, **kwargs)
    assert got_out is out

    msg = f"seed={seed} dtype={dtype} shape={tuple(inputs['query'].shape)} S={inputs['cache_keys'].shape[2]}"
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


DECODE_CASES = [
    # dtype, B, Hkv, G, S, D, validity, padding, strided, num_splits
    pytest.param(torch.float32, 2, 2, 4, 37, 64, "random", False, True, None, id="fp32-G4-D64-S37-strided-splits"),
    pytest.param(torch.float32, 1, 2, 1, 19, 80, "all", False, False, 1, id="fp32-G1-D80-allvalid-1split"),
    pytest.param(torch.float32, 2, 1, 8, 33, 64, "one", True, False, None, id="fp32-G8-oneslot-padding"),
    pytest.param(torch.float16, 2, 2, 8, 40, 80, "random", True, True, 2, id="fp16-G8-D80-padding-strided"),
    pytest.param(torch.float16, 1, 1, 3, 5, 64, "all", False, False, None, id="fp16-G3-S5"),
    pytest.param(torch.bfloat16, 2, 1, 2, 29, 80, "random", True, False, None, id="bf16-G2-D80-padding"),
]


@in_process
@pytest.mark.parametrize("dtype,batch,kv_heads,group,slots,head_dim,validity,padding,strided,num_splits", DECODE_CASES)
def test_decode_matches_reference(dtype, batch, kv_heads, group, slots, head_dim, validity, padding, strided, num_splits):
    seed = fresh_seed()
    inputs, _ = make_inputs(batch, kv_heads, group, 1, slots, head_dim, dtype, validity=validity,
                            padding=padding, strided=strided)
    check_attention(decode_attend_with_scores, inputs, seed, num_splits=num_splits)


@in_process
def test_decode_empty_cache_and_no_scoring():
    seed = fresh_seed()
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


@in_process
@pytest.mark.parametrize("dtype,batch,kv_heads,group,q_len,slots,head_dim,validity,padding,strided", CHUNK_CASES)
def test_chunk_matches_reference(dtype, batch, kv_heads, group, q_len, slots, head_dim, validity, padding, strided):
    seed = fresh_seed()
    inputs, _ = make_inputs(batch, kv_heads, group, q_len, slots, head_dim, dtype, validity=validity,
                            padding=padding, strided=strided)
    check_attention(chunk_attend_with_scores, inputs, seed)


@in_process
def test_chunk_single_token_equals_decode():
    """The chunk kernel also takes Q == 1; both kernels must agree with each other."""
    seed = fresh_seed()
    inputs, _ = make_inputs(1, 2, 4, 1, 23, 64, torch.float32, padding=False)
    check_attention(chunk_attend_with_scores, inputs, seed)


def make_evict_inputs(batch, kv_heads, slots, head_dim, dtype, ties):
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
    return state, new


@pytest.mark.parametrize("dtype,slots,head_dim,ties,block_s", [
    (torch.float32, 37, 80, False, None),
    (torch.bfloat16, 40, 64, True, 16),
    (torch.float16, 21, 64, True, 16),
])
@in_process
def test_evict_matches_reference(dtype, slots, head_dim, ties, block_s):
    seed = fresh_seed()
    state, new = make_evict_inputs(2, 3, slots, head_dim, dtype, ties)
    mine = [t.clone() for t in state]
    want = reference.evict_and_insert(*state, *new)
    got = triton_evict(*mine, *new, block_s=block_s)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), f"seed={seed}"
    for a, b in zip(mine, state):
        assert torch.equal(a, b), f"seed={seed}"


@in_process
def test_evict_strided_buffers():
    """Slot tensors that are views of a larger buffer (the cache may scan fewer slots than it holds)."""
    seed = fresh_seed()
    state, new = make_evict_inputs(1, 2, 30, 64, torch.float32, ties=False)
    big = [torch.cat([t, t[:, :, :5]], dim=2) for t in state]
    views = [t[:, :, :30] for t in big]
    copies = [t.clone() for t in big]
    want = reference.evict_and_insert(*[t[:, :, :30] for t in copies], *new)
    got = triton_evict(*views, *new)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), f"seed={seed}"
    for a, b in zip(big, copies):
        assert torch.equal(a, b), f"seed={seed}"


@in_process
def test_dispatch_honours_env(monkeypatch):
    import h2ochat_kernels
    from h2ochat_kernels import triton_chunk, triton_decode, triton_evict

    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(triton_decode, "decode_attend_with_scores", spy("decode", triton_decode.decode_attend_with_scores))
    monkeypatch.setattr(triton_chunk, "chunk_attend_with_scores", spy("chunk", triton_chunk.chunk_attend_with_scores))
    monkeypatch.setattr(triton_evict, "evict_and_insert", spy("evict", triton_evict.evict_and_insert))
    seed = fresh_seed()

    def run_all():
        for q_len in (1, 3):
            inputs, _ = make_inputs(1, 1, 2, q_len, 18, 64, torch.float32)
            ref_scores = inputs["scores"].clone()
            want, _ = reference.attend_with_scores(**{**inputs, "scores": ref_scores})
            got, _ = h2ochat_kernels.attend_with_scores(**inputs)
            assert rel_err(got, want) < 1e-5, f"seed={seed}"
        state, new = make_evict_inputs(1, 2, 20, 64, torch.float32, ties=False)
        h2ochat_kernels.evict_and_insert(*state, *new)

    monkeypatch.setenv("H2OCHAT_KERNELS", "torch")
    assert h2ochat_kernels.kernel_backend(torch.device("cpu")) == "torch"
    run_all()
    assert calls == []

    monkeypatch.setenv("H2OCHAT_KERNELS", "triton")
    assert h2ochat_kernels.kernel_backend(torch.device("cpu")) == "triton"
    run_all()
    assert calls == ["decode", "chunk", "evict"]

    calls.clear()
    monkeypatch.setenv("H2OCHAT_KERNELS", "auto")  # CPU tensors: torch
    assert h2ochat_kernels.kernel_backend("cpu") == "torch"
    run_all()
    assert calls == []
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
