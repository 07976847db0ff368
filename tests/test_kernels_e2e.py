"""End to end: a tiny random Llama decoding through the H2O cache, Triton kernels vs torch.

The same model and prompt run twice, once with H2OCHAT_KERNELS=torch and once with
H2OCHAT_KERNELS=triton (the kernels under the Triton interpreter, on the CPU). Eviction goes through
whichever entry the cache uses (``evict_by_policy``, fused, or ``evict_and_insert`` with a priority). The prompt is fed in
chunks (the chunk kernel, with and without cached slots, with left padding), then tokens are decoded
greedily past the cache budget, so the decode kernel and the eviction kernel run too. Both runs
are fed the same tokens and must give close logits, the same kept tokens (up to an eviction whose
candidates tie within rounding) and close accumulated scores in every layer. Also with the slots
quantised (int8, int4), the kernels taking the codes.
"""

from __future__ import annotations

import contextlib
import os

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from conftest import triton_interpreter_ready  # noqa: E402
from lockstep import EvictionRecorder, lockstep  # noqa: E402

in_process = pytest.mark.skipif(not triton_interpreter_ready(), reason="triton was imported before TRITON_INTERPRET=1 "
                                "(conftest.py sets it first: run through pytest from the repository)")


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    import h2ochat.engine.attention  # noqa: F401  registers "h2o"

    config = LlamaConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=128, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(config, attn_implementation="h2o", dtype=torch.float32).eval()


@contextlib.contextmanager
def _kernels(backend: str):
    os.environ["H2OCHAT_KERNELS"] = backend
    try:
        yield
    finally:
        del os.environ["H2OCHAT_KERNELS"]


def _prefilled(model, backend: str, prompt, mask, policy: str, kv_dtype: str = "auto"):
    from h2ochat.engine.generation import CacheSettings, prefill

    with _kernels(backend):
        cache = CacheSettings(policy=policy, budget="12", heavy_ratio=0.5, kv_dtype=kv_dtype).build(model)
        return cache, prefill(model, cache, prompt, mask, chunk=4)


def _assert_codes_at_most_one_apart(mine, ref, msg: str) -> None:
    """Quantised slots: the two caches' dequantised keys and values differ by at most one code step."""
    for a, b in zip(mine.layers, ref.layers):
        for part, (x, y) in zip(("key", "value"), zip(a.format.keys_and_values(a.slot_view()),
                                                      b.format.keys_and_values(b.slot_view()))):
            step = b.stored[f"{part}_scale"].unsqueeze(-1) * (1 + 1e-3)
            assert bool(((x - y).abs() <= step + 1e-5).all()), f"{msg}: layer {b.layer_idx} {part}s"


# Both runs quantise with the same code (reference.write_slots), but what they quantise comes from
# hidden states a rounding apart: a key or value a rounding away from a level boundary may take the
# next code. After such a flip it is read a code step apart, and logits and scores drift by more than
# rounding: one int8 value code moved the prefill logits by 1.4e-4, one int4 key code (spread by the
# rotation over 32 dimensions) the scores by 1.4e-4 relative (seed 1317592470); without a flip both
# stay under 3e-6 (81 seeds). A wrong mask or a missed slot moves them by orders more than 1e-3.
def _tolerance(mine, ref) -> float:
    flipped = ref.layers[0].format.quantized and any(
        not torch.equal(a.stored[name], b.stored[name]) for a, b in zip(mine.layers, ref.layers) for name in ("keys", "values"))
    return 1e-3 if flipped else 1e-4


def _decoder(model, cache, backend: str):
    from h2ochat.engine.forward_step import forward

    def decode(tokens):
        with _kernels(backend):
            return forward(model, cache, tokens.unsqueeze(1), logits_to_keep=1)[:, -1]

    return decode


@in_process
@pytest.mark.parametrize("policy,kv_dtype", [
    ("h2o", "auto"),
    # a score decay in both attention kernels; eviction ranked by score / age x value norm, with sinks
    ("mean:decay=0.5:value_eps=0.1", "auto"),
    # quantised slots (--kv-dtype): the codes dequantised inside both attention kernels; int4 keys
    # and queries turned by the spreading rotation before they reach them
    ("h2o", "int8"),
    ("h2o", "int4"),
])
def test_triton_and_torch_decode_the_same(monkeypatch, policy, kv_dtype, seed):
    from h2ochat_kernels import dispatch

    model = _tiny_llama(seed)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 96, (2, 10), generator=gen)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding on the second sequence

    calls = []  # (kernel, the backend the layer chose at allocation)
    for name in ("attend_with_scores", "evict_and_insert", "evict_by_policy"):
        original = getattr(dispatch.Backend, name)

        def spy(backend, *args, _name=name, _fn=original, **kwargs):
            calls.append((_name, backend.name))
            return _fn(backend, *args, **kwargs)

        monkeypatch.setattr(dispatch.Backend, name, spy)

    want_cache, want_logits = _prefilled(model, "torch", prompt, mask, policy, kv_dtype)
    assert {b for _, b in calls} == {"torch"}
    calls.clear()
    got_cache, got_logits = _prefilled(model, "triton", prompt, mask, policy, kv_dtype)
    msg = f"seed={seed} policy={policy} kv_dtype={kv_dtype}"
    tolerance = _tolerance(got_cache, want_cache)
    assert torch.allclose(got_logits, want_logits, rtol=tolerance, atol=tolerance), msg
    # both fed the torch run's greedy tokens; where two slots' priorities tie within rounding the
    # runs may keep different tokens, and the comparison stops there (tests/lockstep.py)
    recorder = EvictionRecorder(want_cache)
    with recorder.recording():
        compared = lockstep(_decoder(model, want_cache, "torch"), _decoder(model, got_cache, "triton"), want_logits, 8,
                            atol=1e-4, rtol=1e-4, recorder=recorder, caches=(want_cache, got_cache), where=msg,
                            tolerance=lambda: (_tolerance(got_cache, want_cache),) * 2)
    assert ("attend_with_scores", "triton") in calls, msg  # the triton run's decode steps took the kernels
    evictions = {name for name, backend in calls if name.startswith("evict") and backend == "triton"}
    # (quantised slots are overwritten by the layer itself, codes and scales: reference.write_slots)
    assert evictions or kv_dtype != "auto", "the run never evicted: raise new_tokens"
    assert want_cache.evicted_tokens() > 0, msg
    if compared < 8:
        return  # a legitimate near-tie; everything up to it agreed
    if want_cache.layers[0].format.quantized:
        _assert_codes_at_most_one_apart(got_cache, want_cache, msg)
    score_rtol = _tolerance(got_cache, want_cache)
    for mine, ref in zip(got_cache.layers, want_cache.layers):
        assert torch.equal(mine.token_index, ref.token_index), msg
        assert torch.equal(mine.positions, ref.positions), msg
        if not ref.format.quantized:
            assert torch.allclose(mine.keys, ref.keys, atol=1e-5), msg
        valid = ref.token_index >= 0
        assert torch.allclose(mine.scores[valid], ref.scores[valid], rtol=score_rtol, atol=1e-5), msg
        if getattr(ref, "value_norm", None) is not None:
            assert torch.allclose(mine.value_norm[valid], ref.value_norm[valid], rtol=1e-5, atol=1e-6), msg
