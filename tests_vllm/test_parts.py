"""The plugin's parts against obvious references, without starting vLLM: the block choice, the block
scores, the row compaction and the options."""

from __future__ import annotations

import pytest
import torch

from h2ochat.policies import get_policy
from h2ochat_vllm import reference
from h2ochat_vllm.choice import blocks_to_evict
from h2ochat_vllm.scores import block_scores, decode_block_scores
from h2ochat_vllm.settings import read_settings
from h2ochat_vllm.worker_state import StepOptions


@pytest.mark.parametrize("seed", range(20))
def test_the_choice_is_the_reference_rule(seed):
    generator = torch.Generator().manual_seed(seed)
    blocks = int(torch.randint(3, 40, (1,), generator=generator))
    budget_blocks = int(torch.randint(3, 12, (1,), generator=generator))
    sinks = int(torch.randint(0, 2, (1,), generator=generator))
    policy = get_policy(f"h2o:sinks={sinks}")
    budget = policy.split(budget_blocks)
    scores = torch.rand(blocks, generator=generator)
    evicted = set(torch.randperm(blocks, generator=generator)[: blocks // 4].tolist()) - set(range(sinks))
    computed = int(torch.randint(0, blocks * 16, (1,), generator=generator))
    total = max(computed + 1, (blocks - 1) * 16 + 1)
    held = [b for b in range(-(-total // 16)) if b not in evicted]
    expected = set(evicted)
    reference.evict_before_step(reference.BlockRule(16, budget.slots, budget.sinks, budget.recent),
                                {b: float(s) for b, s in enumerate(scores)}, expected, total, computed)
    chosen = blocks_to_evict(policy, budget, scores, held, computed // 16)
    assert set(chosen) == expected - evicted
    assert not set(chosen) & set(range(sinks))


def dense_block_scores(query, keys, seq_len, scale, block_size):
    """Softmax over the full [H, n, S] logits with a causal mask, grouped query heads by repetition."""
    n, heads, dim = query.shape
    keys = keys.repeat_interleave(heads // keys.shape[0], dim=0)  # [H, S, D]
    logits = torch.einsum("nhd,hsd->hns", query, keys) * scale
    for i in range(n):
        logits[:, i, seq_len - n + i + 1:] = float("-inf")
    column = torch.softmax(logits, dim=-1).sum(dim=(0, 1))
    return torch.stack([column[b * block_size:(b + 1) * block_size].sum() for b in range(-(-seq_len // block_size))])


@pytest.mark.parametrize("n,seq_len", [(1, 70), (5, 70), (32, 96)])
def test_block_scores_equal_dense_attention(n, seq_len):
    generator = torch.Generator().manual_seed(n)
    block_size, kv_heads, heads, dim = 32, 2, 4, 16
    cache = torch.randn(10, kv_heads, dim, block_size, generator=generator)  # vLLM's CPU layout: channel-major
    blocks = torch.tensor([7, 2, 5])
    keys = cache[blocks].permute(1, 0, 3, 2).reshape(kv_heads, -1, dim)[:, :seq_len]
    query = torch.randn(n, heads, dim, generator=generator)
    got = block_scores(query, cache, blocks, seq_len, 0.25)
    torch.testing.assert_close(got, dense_block_scores(query, keys, seq_len, 0.25, block_size), rtol=1e-5, atol=1e-5)
    assert got.sum().item() == pytest.approx(n * heads, rel=1e-5)  # every query's probabilities sum to 1


def test_settings_need_a_budget_and_read_the_policy(monkeypatch):
    monkeypatch.delenv("H2OCHAT_VLLM_BUDGET", raising=False)
    with pytest.raises(ValueError, match="budget"):
        read_settings({}, None)
    settings = read_settings({"budget": 1000}, {"h2ochat": {"policy": "mean"}})
    assert settings.policy.name == "mean" and settings.blocks(128).slots == 7
    monkeypatch.setenv("H2OCHAT_VLLM_BUDGET", "512")
    assert read_settings({"budget": 1000}, None).budget_tokens == 512
    monkeypatch.delenv("H2OCHAT_VLLM_BUDGET")
    with pytest.raises(ValueError, match="needs at least"):
        read_settings({"budget": 100}, None).blocks(128)


def test_decode_batch_scores_equal_one_row_at_a_time():
    generator = torch.Generator().manual_seed(7)
    block_size, kv_heads, heads, dim = 32, 3, 9, 16
    cache = torch.randn(12, kv_heads, dim, block_size, generator=generator)
    blocks = torch.tensor([[3, 1, 4, 0], [5, 9, 0, 0], [2, 6, 7, 8]])  # padded past each row's own
    lens = torch.tensor([100, 33, 128])
    query = torch.randn(3, heads, dim, generator=generator)
    got = decode_block_scores(query, cache, blocks, lens, 0.125)
    for row in range(3):
        kept = -(-int(lens[row]) // block_size)
        one = block_scores(query[row:row + 1], cache, blocks[row, :kept], int(lens[row]), 0.125)
        torch.testing.assert_close(got[row, :kept], one, rtol=1e-5, atol=1e-6)
        assert got[row, kept:].abs().max() == 0 if kept < 4 else True


def test_score_every_reads_and_scores_one_token_steps_at_multiples(monkeypatch):
    from h2ochat_vllm.worker_state import StepState

    monkeypatch.delenv("H2OCHAT_VLLM_SCORE_EVERY", raising=False)
    assert read_settings({"budget": 1024}, None).score_every == 1
    assert read_settings({"budget": 1024}, {"h2ochat": {"score_every": 4}}).score_every == 4
    monkeypatch.setenv("H2OCHAT_VLLM_SCORE_EVERY", "0")
    with pytest.raises(ValueError, match="score_every"):
        read_settings({"budget": 1024}, None)
    state = StepState()
    state.set_plans({}, StepOptions(score_every=4))
    assert [p for p in range(300, 310) if state.scores_token_at(p)] == [300, 304, 308]
    state.set_plans({})
    assert all(state.scores_token_at(p) for p in range(300, 310))


def test_importing_the_plugin_imports_no_vllm():
    """Only ``register`` (vLLM's hook), the backend and the connector import vLLM: the package, its
    choice, scores, options, cold blocks and reference load without it."""
    import subprocess
    import sys

    code = ("import sys, h2ochat_vllm, h2ochat_vllm.choice, h2ochat_vllm.settings, h2ochat_vllm.scores, "
            "h2ochat_vllm.reference, h2ochat_vllm.worker_state, h2ochat_vllm.cold_blocks; print('vllm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_key_view_reads_the_keys_vllm_writes(dtype, isa):
    """vLLM's CPU kernels store a block's keys channel-major (not [block_size, D]): ``key_view`` of a cache that
    vLLM's own writer filled gives back every key at its block and place, and the values stay apart."""
    from vllm import _custom_ops as ops

    from h2ochat_vllm.rest import keys_and_values
    from h2ochat_vllm.scores import key_view, value_view

    generator = torch.Generator().manual_seed(3)
    num_blocks, kv_heads, block_size, dim, tokens = 4, 2, 32, 64, 70
    kv_cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * dim, dtype=dtype)
    key_cache, value_cache = kv_cache.view(num_blocks, kv_heads, 2 * block_size, dim).chunk(2, dim=2)
    key, value = (torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(tokens) + block_size, isa)
    keys = key_view(kv_cache)  # [num_blocks, Hkv, D, block_size]
    stored = keys[1:].permute(0, 3, 1, 2).reshape(-1, kv_heads, dim)[:tokens]  # token-major, from block 1 on
    assert torch.equal(stored, key)
    assert keys[0].abs().max() == 0
    values = value_view(kv_cache)[1:].permute(0, 2, 1, 3).reshape(-1, kv_heads, dim)[:tokens]  # token-major
    assert torch.equal(values, value)
    both = keys_and_values(kv_cache[1:])  # [Hkv, tokens, D] each, as the rest in prompt chunks reads them
    assert torch.equal(both[0][:, :tokens].transpose(0, 1), key) and torch.equal(both[1][:, :tokens].transpose(0, 1), value)
