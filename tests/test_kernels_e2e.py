"""End to end: a tiny random Llama decoding through the H2O cache, Triton kernels vs torch.

The same model and prompt run twice, once with H2OCHAT_KERNELS=torch and once with
H2OCHAT_KERNELS=triton (the kernels under the Triton interpreter, on the CPU). Eviction goes through
whichever entry the cache uses (``evict_by_policy``, fused, or ``evict_and_insert`` with a priority). The prompt is fed in
chunks (the chunk kernel, with and without cached slots, with left padding), then tokens are decoded
greedily past the cache budget, so the decode kernel and the eviction kernel run too. Both runs
must pick the same tokens, with close logits and close accumulated scores in every layer.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from conftest import triton_interpreter_ready  # noqa: E402

in_process = pytest.mark.skipif(not triton_interpreter_ready(), reason="triton was imported before TRITON_INTERPRET=1 "
                                "(conftest.py sets it first: run through pytest from the repository)")


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    import h2ochat.attention  # noqa: F401  registers "h2o"

    config = LlamaConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=128, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(config, attn_implementation="h2o", dtype=torch.float32).eval()


def _run(model, backend: str, prompt, mask, new_tokens: int, policy: str):
    from h2ochat.generation import CacheSettings, forward, prefill

    os.environ["H2OCHAT_KERNELS"] = backend
    try:
        cache = CacheSettings(policy=policy, budget="12", heavy_ratio=0.5).build(model)
        logits = prefill(model, cache, prompt, mask, chunk=4)
        tokens, all_logits = [], [logits]
        for _ in range(new_tokens):
            nxt = logits.argmax(dim=-1)
            tokens.append(nxt)
            logits = forward(model, cache, nxt.unsqueeze(1), logits_to_keep=1)[:, -1]
            all_logits.append(logits)
        return torch.stack(tokens, 1), torch.stack(all_logits, 1), cache
    finally:
        del os.environ["H2OCHAT_KERNELS"]


@in_process
@pytest.mark.parametrize("policy", [
    "h2o",
    # a score decay in both attention kernels; eviction ranked by score / age x value norm, with sinks
    "mean:decay=0.5:value_eps=0.1",
])
def test_triton_and_torch_decode_the_same(monkeypatch, policy):
    from h2ochat_kernels import dispatch

    seed = int(os.environ.get("H2OCHAT_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
    model = _tiny_llama(seed)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 96, (2, 10), generator=gen)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding on the second sequence

    calls = []
    for name in ("attend_with_scores", "evict_and_insert", "evict_by_policy"):
        original = getattr(dispatch, name)

        def spy(*args, _name=name, _fn=original, **kwargs):
            calls.append((_name, dispatch.kernel_backend(args[1].device)))
            return _fn(*args, **kwargs)

        monkeypatch.setattr(dispatch, name, spy)
        monkeypatch.setattr(sys.modules["h2ochat_kernels"], name, spy)

    want_tokens, want_logits, want_cache = _run(model, "torch", prompt, mask, new_tokens=8, policy=policy)
    assert {b for _, b in calls} == {"torch"}
    calls.clear()
    got_tokens, got_logits, got_cache = _run(model, "triton", prompt, mask, new_tokens=8, policy=policy)
    assert {b for _, b in calls} == {"triton"}
    evictions = {name for name, backend in calls if name.startswith("evict") and backend == "triton"}
    assert evictions, "the run never evicted: raise new_tokens"

    msg = f"seed={seed} policy={policy} evictions={sorted(evictions)}"
    assert torch.equal(got_tokens, want_tokens), msg
    assert torch.allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4), msg
    assert want_cache.evicted_tokens() > 0, msg
    for mine, ref in zip(got_cache.layers, want_cache.layers):
        assert torch.equal(mine.token_index, ref.token_index), msg
        assert torch.equal(mine.positions, ref.positions), msg
        valid = ref.token_index >= 0
        assert torch.allclose(mine.scores[valid], ref.scores[valid], rtol=1e-4, atol=1e-5), msg
        assert torch.allclose(mine.keys, ref.keys, atol=1e-5), msg
        if getattr(ref, "value_norm", None) is not None:
            assert torch.allclose(mine.value_norm[valid], ref.value_norm[valid], rtol=1e-5, atol=1e-6), msg
