"""End to end: a tiny random Llama decoding through the H2O cache, Triton kernels vs torch.

The same model and prompt run twice, once with H2OCHAT_KERNELS=torch and once with
H2OCHAT_KERNELS=triton (the kernels under the Triton interpreter, on the CPU). The prompt is fed in
chunks (the chunk kernel, with and without cached slots, with left padding), then tokens are decoded
greedily past the cache budget, so the decode kernel and the eviction kernel run too. Both runs
must pick the same tokens, with close logits and close accumulated scores in every layer.
"""

from __future__ import annotations

import os
import sys

# See test_kernels.py: triton's library must be built for the interpreter, which needs
# TRITON_INTERPRET=1 before triton is first imported (conftest.py imports it through transformers).


def _triton_built_without_interpreter() -> bool:
    """True when triton is already imported and its library (tl.zeros, tl.sum, ...) was built for
    GPU compilation: the interpreter cannot run kernels in this process then."""
    if "triton" not in sys.modules:
        return False
    try:
        import triton.language as tl
    except Exception:
        return False
    return type(tl.zeros).__name__ != "InterpretedFunction"


_TRITON_PREIMPORTED = _triton_built_without_interpreter()
if not _TRITON_PREIMPORTED:  # (else leave this process alone: nothing here runs in it)
    os.environ["TRITON_INTERPRET"] = "1"  # before any module that defines kernels is imported

import subprocess  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

in_process = pytest.mark.skipif(_TRITON_PREIMPORTED, reason="triton was imported before TRITON_INTERPRET=1: "
                                "run by test_e2e_in_fresh_process")


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="triton's interpreter is active in this process")
def test_e2e_in_fresh_process():
    env = {k: v for k, v in os.environ.items() if k != "H2OCHAT_KERNELS"}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "--noconftest", "-p", "no:cacheprovider"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


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


def _run(model, backend: str, prompt, mask, new_tokens: int):
    from h2ochat.generation import CacheSettings, forward, prefill

    os.environ["H2OCHAT_KERNELS"] = backend
    try:
        cache = CacheSettings(policy="h2o", budget="12", heavy_ratio=0.5).build(model)
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
def test_triton_and_torch_decode_the_same(monkeypatch):
    from h2ochat_kernels import dispatch

    seed = int(os.environ.get("H2OCHAT_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
    model = _tiny_llama(seed)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 96, (2, 10), generator=gen)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding on the second sequence

    calls = []
    for name in ("attend_with_scores", "evict_and_insert"):
        original = getattr(dispatch, name)

        def spy(*args, _name=name, _fn=original, **kwargs):
            calls.append((_name, dispatch.kernel_backend(args[1].device)))
            return _fn(*args, **kwargs)

        monkeypatch.setattr(dispatch, name, spy)
        monkeypatch.setattr(sys.modules["h2ochat_kernels"], name, spy)

    want_tokens, want_logits, want_cache = _run(model, "torch", prompt, mask, new_tokens=8)
    assert {b for _, b in calls} == {"torch"}
    calls.clear()
    got_tokens, got_logits, got_cache = _run(model, "triton", prompt, mask, new_tokens=8)
    assert {b for _, b in calls} == {"triton"}
    assert ("evict_and_insert", "triton") in calls, "the run never evicted: raise new_tokens"

    msg = f"seed={seed}"
    assert torch.equal(got_tokens, want_tokens), msg
    assert torch.allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4), msg
    assert want_cache.evicted_tokens() > 0, msg
    for mine, ref in zip(got_cache.layers, want_cache.layers):
        assert torch.equal(mine.token_index, ref.token_index), msg
        assert torch.equal(mine.positions, ref.positions), msg
        valid = ref.token_index >= 0
        assert torch.allclose(mine.scores[valid], ref.scores[valid], rtol=1e-4, atol=1e-5), msg
        assert torch.allclose(mine.keys, ref.keys, atol=1e-5), msg
