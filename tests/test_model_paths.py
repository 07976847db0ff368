"""Whole models (tiny random OPT, Llama with GQA, GPT-NeoX) through the H2O cache, each against an
independent reference: the model without a cache, masked full attention over a plain cache,
each sequence run alone, and stock transformers generation."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

import h2ochat_kernels
from h2ochat.cache import PositionLimitError
from h2ochat.generation import CacheSettings, forward, prefill
from h2ochat.rotary import find_rotary, rotate_keys

from conftest import build_model, random_ids


def twin(model, family, attn="sdpa", **overrides):
    """The same weights under another attention implementation (or config tweak)."""
    other = build_model(family, attn=attn, **overrides)
    other.load_state_dict(model.state_dict())
    return other


def test_budget_covering_the_text_gives_the_full_cache_logits(family):
    model = build_model(family)
    ids = random_ids(2, 40)
    with torch.inference_mode():
        expected = model(ids, use_cache=False).logits  # falls back to plain causal sdpa
    cache = CacheSettings(budget="40").build(model)
    logits = [forward(model, cache, ids[:, :13]), forward(model, cache, ids[:, 13:30])]
    logits += [forward(model, cache, ids[:, t : t + 1]) for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(logits, dim=1), expected, rtol=1e-5, atol=1e-5)
    assert cache.evicted_tokens() == 0


# -- masked full attention ---------------------------------------------------------------------

VISIBLE: dict[int, torch.Tensor] = {}  # layer -> [B, Hkv, T] tokens the step may read


def _masked_reference_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Full attention over every past token, minus the ones the H2O cache had evicted."""
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    visible = VISIBLE[module.layer_idx].repeat_interleave(group, 1)[:, :, None, :]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    logits = (query @ keys.transpose(-1, -2)) * scale
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ values).transpose(1, 2).contiguous(), None


AttentionInterface.register("masked_reference", _masked_reference_attention)


@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_compacted_cache_equals_full_attention_with_evicted_keys_masked(family, policy):
    model = build_model(family)
    reference = twin(model, family, attn="masked_reference")
    ids = random_ids(2, 30)
    cache = CacheSettings(policy=policy, budget="8", positions="absolute", sinks=2).build(model)
    full = DynamicCache(config=reference.config)
    for t in range(ids.shape[1]):
        for layer_idx, layer in enumerate(cache.layers):
            visible = torch.zeros(2, model.config.num_key_value_heads if family == "llama" else
                                  model.config.num_attention_heads, t + 1, dtype=torch.bool)
            if layer.is_initialized:
                held = layer.token_index[:, :, : layer.used]
                visible.scatter_(2, held.clamp(min=0), held >= 0)
            visible[:, :, t] = True
            VISIBLE[layer_idx] = visible
        got = forward(model, cache, ids[:, t : t + 1])
        with torch.inference_mode():
            expected = reference(ids[:, t : t + 1], cache=full, use_cache=True).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert cache.evicted_tokens() > 0


def test_left_padded_batch_equals_each_sequence_alone(family):
    model = build_model(family)
    pad = model.config.pad_token_id
    prompts = [random_ids(1, 8)[0], random_ids(1, 5)[0]]
    batch_ids = torch.full((2, 8), pad)
    mask = torch.zeros(2, 8, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch_ids[row, 8 - len(prompt):], mask[row, 8 - len(prompt):] = prompt, 1
    follow = random_ids(2, 14)  # teacher-forced continuation, evicting from step 1 on
    settings = CacheSettings(budget="8")
    batch_cache = settings.build(model)
    batched = [prefill(model, batch_cache, batch_ids, mask)]
    batched += [forward(model, batch_cache, follow[:, t : t + 1])[:, -1] for t in range(follow.shape[1])]
    for row, prompt in enumerate(prompts):
        cache = settings.build(model)
        alone = [prefill(model, cache, prompt[None])]
        alone += [forward(model, cache, follow[row : row + 1, t : t + 1])[:, -1] for t in range(follow.shape[1])]
        for step, (b, a) in enumerate(zip(batched, alone)):
            torch.testing.assert_close(b[row], a[0], rtol=1e-5, atol=1e-5, msg=f"row {row} step {step}")
        for layer_b, layer_a in zip(batch_cache.layers, cache.layers):
            kept_b = layer_b.token_index[row].sort(-1).values
            kept_a = layer_a.token_index[0].sort(-1).values
            assert torch.equal(kept_b[kept_b >= 0], kept_a[kept_a >= 0])
    assert batch_cache.evicted_tokens() > 0


def test_long_prompt_is_prefilled_in_bounded_memory(family, monkeypatch):
    model = build_model(family, max_position_embeddings=2048)
    widest = []
    attend = h2ochat_kernels.attend_with_scores

    def recording(query, cache_keys, *args):
        widest.append(cache_keys.shape[2] + query.shape[3])
        return attend(query, cache_keys, *args)

    monkeypatch.setattr(h2ochat_kernels, "attend_with_scores", recording)
    cache = CacheSettings(budget="16").build(model)
    prefill(model, cache, random_ids(1, 160), chunk=8)  # 10x the budget
    assert max(widest) <= 16 + 8
    for layer in cache.layers:
        assert layer.keys.shape[2] == 16 and int((layer.token_index >= 0).sum(-1).min()) == 16
    per_slot = cache.layers[0].keys[0, :, 0].numel() * 4 * 2
    assert cache.kv_bytes() == len(cache.layers) * 16 * per_slot
    assert cache.full_kv_bytes() == len(cache.layers) * 160 * per_slot


def test_generation_runs_past_the_position_limit(family):
    model = build_model(family)  # max_position_embeddings = 64
    cache = CacheSettings(budget="16").build(model)
    token = random_ids(1, 1)
    prefill(model, cache, random_ids(1, 10))
    for _ in range(300):
        token = forward(model, cache, token)[:, -1:].argmax(-1)
    assert cache.tokens_seen() == 310 and cache.compactions >= 5
    assert int(cache.layers[0].positions.max()) < 64

    absolute = CacheSettings(budget="16", positions="absolute").build(model)
    prefill(model, absolute, random_ids(1, 60))
    with pytest.raises(PositionLimitError, match="64-position limit"):
        for _ in range(10):
            forward(model, absolute, random_ids(1, 1))


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_renumbering_a_window_leaves_rope_logits_unchanged(family):
    """A sliding window's kept tokens are contiguous, so re-numbering them is a uniform shift,
    to which RoPE attention is blind: compact mode must match a model with room to spare."""
    model = build_model(family)
    roomy = twin(model, family, attn="h2o", max_position_embeddings=4096)
    ids = random_ids(1, 150)
    compact = CacheSettings(policy="local", budget="12").build(model)
    absolute = CacheSettings(policy="local", budget="12", positions="absolute").build(roomy)
    for t in range(ids.shape[1]):
        a = forward(model, compact, ids[:, t : t + 1])
        b = forward(roomy, absolute, ids[:, t : t + 1])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert compact.compactions >= 2 and absolute.compactions == 0


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_rotating_a_key_equals_encoding_it_at_the_new_position(family):
    model = build_model(family)
    rotary = find_rotary(model)
    rope = model.model.rotary_emb if family == "llama" else model.gpt_neox.rotary_emb
    raw = torch.randn(1, 2, 5, 16)
    old, new = torch.randint(0, 500, (1, 5)), torch.randint(0, 500, (1, 5))

    def encode(positions):
        cos, sin = rope(raw, positions)
        dim = cos.shape[-1]
        half = torch.cat([-raw[..., dim // 2 : dim], raw[..., : dim // 2]], dim=-1)
        out = raw.clone()
        out[..., :dim] = raw[..., :dim] * cos[:, None] + half * sin[:, None]
        return out

    keys = encode(old)
    rotate_keys(keys, (new - old)[:, None, :].expand(1, 2, 5), rotary)
    torch.testing.assert_close(keys, encode(new), rtol=1e-4, atol=1e-4)


def test_generate_with_padding_and_a_second_turn_matches_stock_transformers(family):
    model = build_model(family)
    reference = twin(model, family)
    pad = model.config.pad_token_id
    ids = random_ids(2, 10)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = pad, 0
    cache = CacheSettings(budget="64").build(model)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=pad)
    first = model.generate(ids, attention_mask=mask, cache=cache, **options)
    assert torch.equal(first, reference.generate(ids, attention_mask=mask, **options))
    second_ids = torch.cat([first, random_ids(2, 4)], dim=1)
    second_mask = torch.cat([mask, torch.ones(2, second_ids.shape[1] - mask.shape[1], dtype=torch.long)], dim=1)
    second = model.generate(second_ids, attention_mask=second_mask, cache=cache, **options)
    assert torch.equal(second, reference.generate(second_ids, attention_mask=second_mask, **options))
