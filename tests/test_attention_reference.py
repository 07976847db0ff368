"""``kernels.reference.attend_with_scores`` against a slow obvious loop: each query row's softmax over
the slots it may read, and the scores updated token by token (``S <- decay * S + a``), for decode
steps and prompt chunks (a CPU chunk runs the blocked layout, issue 35), with padding, empty slots,
GQA groups, a per-sequence decay and 16-bit slots."""

from __future__ import annotations

import pytest
import torch

from h2ochat_kernels import blocked_chunk, reference


def slow_attention(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scale, scores, decay):
    keys, values, index = cache_keys, cache_values, slot_token_index
    batch, kv_heads, group, q_len, dim = query.shape
    slots = keys.shape[2]
    out = torch.zeros(batch, kv_heads, group, q_len, dim, dtype=torch.float64)
    new_scores = torch.zeros(batch, kv_heads, q_len, dtype=torch.float64)
    scores = scores.double().clone()
    for b in range(batch):
        real = [True] * q_len if new_valid is None else new_valid[b].tolist()
        d = float(decay[b]) if isinstance(decay, torch.Tensor) else float(decay)
        for h in range(kv_heads):
            all_keys = torch.cat([keys[b, h], new_keys[b, h]]).double()
            all_values = torch.cat([values[b, h], new_values[b, h]]).double()
            received = torch.zeros(slots + q_len, dtype=torch.float64)  # this chunk's sum, decayed per later real row
            for i in range(q_len):
                readable = [bool(index[b, h, s] >= 0) for s in range(slots)]
                readable += [j <= i and real[j] for j in range(q_len)]
                allowed = torch.tensor(readable)
                step = torch.zeros(slots + q_len, dtype=torch.float64)
                for g in range(group):
                    logits = (all_keys @ query[b, h, g, i].double()) * scale
                    if allowed.any():
                        logits = logits.masked_fill(~allowed, float("-inf"))
                        probs = logits.softmax(0)
                    else:  # (nothing readable: the reference's finite mask spreads it evenly)
                        probs = torch.full_like(logits, 1.0 / logits.numel())
                    out[b, h, g, i] = probs @ all_values
                    step += probs
                if real[i]:
                    received = received * d + step
                    scores[b, h] *= d
            scores[b, h] += received[:slots]
            new_scores[b, h] = received[slots:]
    return out, new_scores, scores


def inputs(seed: int, batch: int, q_len: int, slots: int, padding: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    kv_heads, group, dim = 2, 3, 8
    index = torch.arange(slots).expand(batch, kv_heads, slots).clone()
    index[..., ::3] = -1  # empty slots
    valid = None
    if padding:
        valid = torch.rand(batch, q_len, generator=g) > 0.3
        valid[:, -1] = True
    return dict(query=torch.randn(batch, kv_heads, group, q_len, dim, generator=g).to(dtype),
                cache_keys=torch.randn(batch, kv_heads, slots, dim, generator=g).to(dtype),
                cache_values=torch.randn(batch, kv_heads, slots, dim, generator=g).to(dtype),
                slot_token_index=index,
                new_keys=torch.randn(batch, kv_heads, q_len, dim, generator=g).to(dtype),
                new_values=torch.randn(batch, kv_heads, q_len, dim, generator=g).to(dtype),
                new_valid=valid, scale=dim ** -0.5,
                scores=torch.rand(batch, kv_heads, slots, generator=g))


@pytest.fixture(params=["query-major", "blocked"])
def layout(request, monkeypatch):
    """Both layouts of a chunk: blocked (two new tokens a block, so a chunk runs several) from 2 tokens
    on, or never."""
    monkeypatch.setattr(blocked_chunk, "BLOCKED_MIN_TOKENS", 2 if request.param == "blocked" else 1 << 30)
    monkeypatch.setattr(blocked_chunk, "CHUNK_BLOCK", 2)
    return request.param


@pytest.mark.parametrize("q_len", [1, 6])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("decay", [1.0, 0.8, "per-row"])
def test_attention_matches_the_slow_loop(seed, layout, q_len, padding, decay):
    batch = 3
    given = inputs(seed, batch, q_len, slots=10, padding=padding)
    if decay == "per-row":
        decay = torch.tensor([1.0, 0.5, 0.0])
    want_out, want_new, want_scores = slow_attention(**{**given, "scores": given["scores"].clone()}, decay=decay)
    scores = given.pop("scores")
    out, new_scores = reference.attend_with_scores(**given, scores=scores, decay=decay)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_scores.double(), want_new, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores.double(), want_scores, rtol=1e-5, atol=1e-6)


def test_a_chunk_over_bf16_slots_matches_the_loop_on_the_same_values(seed, layout):
    """16-bit slots are attended in fp32 (their exact values): the loop on the same bf16 values agrees."""
    given = inputs(seed, 2, 5, slots=12, padding=True, dtype=torch.bfloat16)
    want_out, want_new, want_scores = slow_attention(**{**given, "scores": given["scores"].clone()}, decay=0.9)
    scores = given.pop("scores")
    out, new_scores = reference.attend_with_scores(**given, scores=scores, decay=0.9)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want_out, rtol=1e-2, atol=1e-2)  # (the output is rounded to bf16)
    torch.testing.assert_close(new_scores.double(), want_new, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores.double(), want_scores, rtol=1e-5, atol=1e-6)


def test_cpu_prompt_chunks_run_the_blocked_layout(monkeypatch, seed):
    """Every CPU prompt chunk takes the blocked path, whatever its length; decode steps the query-major one."""
    calls = []
    original = blocked_chunk.attend_blocked
    monkeypatch.setattr(blocked_chunk, "attend_blocked", lambda *a, **k: calls.append(a[0].shape[3]) or original(*a, **k))
    for q_len in (1, 4, 511, 512):
        reference.attend_with_scores(**inputs(seed, 1, q_len, slots=6, padding=False))
    assert calls == [4, 511, 512]


@pytest.mark.parametrize("block", [1, 3, 64])
def test_the_blocks_give_the_whole_chunks_numbers(seed, block):
    """However the chunk is cut into blocks, the output and every key's received attention are the
    whole chunk's (one block), up to fp32 rounding: padding and a decay per row included."""
    given = inputs(seed, 2, 7, slots=9, padding=True)
    weights = reference.row_weights(given["new_valid"], 2, 7, torch.tensor([0.9, 0.5]), torch.device("cpu"))
    args = [given[name] for name in ("query", "cache_keys", "cache_values", "slot_token_index", "new_keys",
                                     "new_values", "new_valid")]
    whole = blocked_chunk.attend_blocked(*args, weights, given["scale"], block=7)
    cut = blocked_chunk.attend_blocked(*args, weights, given["scale"], block=block)
    for want, got in zip(whole, cut):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padding", [False, True])
def test_a_bf16_decode_step_multiplies_the_slots_as_they_are(monkeypatch, seed, padding):
    """A CPU decode step of bf16 queries over bf16 slots runs the two slot products in bf16 (no fp32
    copy of the slots): within bf16 rounding of the slow loop on the same values, scores included."""
    taken = []
    original = reference._multiplies_bf16_slots
    monkeypatch.setattr(reference, "_multiplies_bf16_slots", lambda *a: taken.append(original(*a)) or taken[-1])
    given = inputs(seed, 3, 1, slots=40, padding=padding, dtype=torch.bfloat16)
    want_out, want_new, want_scores = slow_attention(**{**given, "scores": given["scores"].clone()}, decay=0.9)
    scores = given.pop("scores")
    out, new_scores = reference.attend_with_scores(**given, scores=scores, decay=0.9)
    assert taken == [True] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(new_scores.double(), want_new, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(scores.double(), want_scores, rtol=2e-2, atol=2e-3)


def test_fp32_and_quantized_decode_steps_keep_the_fp32_products(seed):
    fp32 = inputs(seed, 1, 1, slots=8, padding=False)
    assert not reference._multiplies_bf16_slots(fp32["query"], fp32["cache_keys"], None, 1)
    bf16 = inputs(seed, 1, 1, slots=8, padding=False, dtype=torch.bfloat16)
    assert reference._multiplies_bf16_slots(bf16["query"], bf16["cache_keys"], None, 1)
    assert not reference._multiplies_bf16_slots(bf16["query"], bf16["cache_keys"], object(), 1)  # quantised slots
    assert not reference._multiplies_bf16_slots(bf16["query"], bf16["cache_keys"], None, 4)  # a prompt chunk
