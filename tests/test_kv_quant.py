"""Quantized KV slots (--kv-dtype int8 / int4) against independent references.

The reference is the slow obvious one: every token's key and value quantized and dequantized on
their own (per token and KV head, min-max over its channels; int4 keys in the spreading rotation's
frame, turned back), and the attention computed over those, with the token being added attended
at full precision in the step that adds it. At the layer level this is the H2O rules' slow
re-statement (``test_cache_rules.SlowReference``) holding round-tripped keys and values; at the
model level a masked full attention over a DynamicCache whose past keys and values are round-tripped
(``qref``, registered below) for all three families, chunked prefill with left padding and decode.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from conftest import FAMILIES, build_model
from h2ochat.engine import compiled
from h2ochat.engine.generation import CacheSettings, forward
from h2ochat.kv import H2OCache
from h2ochat.kv.slot_format import QUANT_BITS
from h2ochat.policies import get_policy
from h2ochat_kernels.rotation import spreading_rotation
from h2ochat.rotary import Rotary, rotate_keys
from lockstep import kept_agree_or_tie

from test_cache_rules import TieAwareReference, _drive, drive_against_reference

QUANTIZED = ["int8", "int4"]


def roundtrip(x: torch.Tensor, bits: int, rotate: bool) -> torch.Tensor:
    """x [..., D] quantized and dequantized per row, the obvious way (int4 keys: in a rotated frame)."""
    x = x.double()
    turn = spreading_rotation(x.shape[-1]).double() if rotate else None
    if turn is not None:
        x = x @ turn
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    levels = 2 ** bits - 1
    step = ((high - low) / levels).clamp_min(1e-12)
    y = ((x - low) / step).round().clamp(0, levels) * step + low
    return (y @ turn.T if turn is not None else y).float()


class QuantizedReference(TieAwareReference):
    """The slow H2O reference whose tokens, once added, are held round-tripped (the value norm a
    policy ranks by stays the token's own)."""

    def __init__(self, policy, slots, bits):
        super().__init__(policy, slots)
        self.bits = bits

    def step(self, queries, keys, values, real, scale):
        before = {id(e) for e in self.entries}
        outputs = super().step(queries, keys, values, real, scale)
        for e in self.entries + getattr(self, "candidates", []):
            if id(e) not in before and "norm" not in e:
                e["norm"] = float(e["value"].norm())
                e["key"] = roundtrip(e["key"], self.bits, self.bits == 4)
                e["value"] = roundtrip(e["value"], self.bits, False)
        return outputs

    def _merit(self, e, newest):
        if self.policy.value_eps is None or "norm" not in e:
            return super()._merit(e, newest)
        merit = e["score"] / (newest - e["token"] + 1) if self.policy.by_age else e["score"]
        return (merit + self.policy.value_eps) * e["norm"]


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("policy,slots,group", [("h2o", 6, 2), ("mean:sinks=1", 7, 2), ("tova:sinks=1", 6, 1),
                                                ("h2o:value_eps=0.05", 6, 2), ("local", 5, 3)])
@pytest.mark.parametrize("chunks", [[1] * 14, [4, 1, 1, 3, 1, 5, 1, 1]], ids=["decode", "chunked"])
def test_quantized_layer_matches_the_slow_reference(kv_dtype, policy, slots, group, chunks, seed):
    """Outputs, kept tokens and scores of a quantized layer equal the slow reference over
    round-tripped keys and values at every step, with left padding."""
    pol = get_policy(policy)
    cache = H2OCache(1, pol, slots, max_positions=10_000, kv_dtype=kv_dtype)
    drive_against_reference(cache, lambda: QuantizedReference(pol, slots, QUANT_BITS[kv_dtype]), chunks, group, seed,
                            dim=16, tolerance=2e-5, score_rel=1e-4, score_abs=1e-5)
    assert cache.layers[0].keys.dtype == torch.uint8


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_round_trip_within_half_a_step(kv_dtype, seed):
    """Each held key (in the rotated frame for int4) and value is within half its scale of the
    token's own, channel by channel; a slot's scale is its (max - min) / levels."""
    batch, heads, dim = 2, 3, 16
    cache = H2OCache(1, "h2o", 8, max_positions=1000, kv_dtype=kv_dtype)
    key, value = torch.randn(batch, heads, 8, dim) * 3, torch.randn(batch, heads, 8, dim)
    query = torch.randn(batch, heads, 8, dim)
    _drive(cache, 0, query, key, value, None, 0.25)
    layer = cache.layers[0]
    fmt = layer.format
    keys, values = fmt.keys_and_values(layer.slot_view())
    bits = QUANT_BITS[kv_dtype]
    turned_key = key @ spreading_rotation(dim) if bits == 4 else key
    turned_held = keys @ spreading_rotation(dim) if bits == 4 else keys
    levels = 2 ** bits - 1
    for held, original, scale in ((turned_held, turned_key, layer.stored["key_scale"]), (values, value, layer.stored["value_scale"])):
        expect_scale = (original.amax(-1) - original.amin(-1)) / levels
        torch.testing.assert_close(scale, expect_scale, rtol=1e-5, atol=1e-6)
        assert bool(((held - original).abs() <= scale.unsqueeze(-1) / 2 + 1e-5).all())


# -- the whole model against masked full attention over round-tripped past keys and values -------

REFERENCE_BITS: dict[str, int] = {}


def qref_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention over a DynamicCache's keys and values, the past ones (all but this step's)
    round-tripped through ``REFERENCE_BITS["bits"]``-bit codes; ``attention_mask``: sdpa's."""
    bits, q_len = REFERENCE_BITS["bits"], query.shape[2]
    past = key.shape[2] - q_len
    key = torch.cat([roundtrip(key[:, :, :past], bits, bits == 4), key[:, :, past:]], dim=2)
    value = torch.cat([roundtrip(value[:, :, :past], bits, False), value[:, :, past:]], dim=2)
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    logits = (query.float() @ key.float().transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
    if attention_mask is None:
        attention_mask = torch.ones(q_len, key.shape[2], dtype=torch.bool).tril(diagonal=past)
    elif attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    logits = logits.masked_fill(~attention_mask, float("-inf"))
    probs = torch.nan_to_num(logits.softmax(dim=-1))  # a padding row reads nothing
    return (probs @ value.float()).transpose(1, 2).contiguous(), None


AttentionInterface.register("qref", qref_attention)
AttentionMaskInterface.register("qref", sdpa_mask)


def reference_logits(family, seed, kv_dtype, ids, mask, chunks):
    REFERENCE_BITS["bits"] = QUANT_BITS[kv_dtype]
    model = build_model(family, attn="qref", seed=seed)
    cache, out, start = DynamicCache(config=model.config), [], 0
    full_mask = mask if mask is not None else torch.ones_like(ids)
    positions = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        for q_len in chunks:
            end = start + q_len
            logits = model(input_ids=ids[:, start:end], attention_mask=full_mask[:, :end],
                           position_ids=positions[:, start:end], past_key_values=cache, use_cache=True).logits
            out.append(logits)
            start = end
    return torch.cat(out, dim=1)


def quantized_logits(model, kv_dtype, ids, mask, chunks, slots):
    cache = CacheSettings(budget=str(slots), kv_dtype=kv_dtype).build(model)
    out, start = [], 0
    for q_len in chunks:
        end = start + q_len
        out.append(forward(model, cache, ids[:, start:end], mask[:, start:end] if mask is not None else None))
        start = end
    return torch.cat(out, dim=1), cache


def padded_chunked_run(family, seed):
    """A tiny ``family`` model and two 20-token rows, the second left-padded by 4, fed as a chunked
    prefill then decode steps (the chunks): what the masked-reference tests feed."""
    model = build_model(family, seed=seed)
    ids = torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return model, ids, mask, [6, 5, 1, 1, 1, 3, 1, 1, 1]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_model_equals_masked_attention_over_dequantized_slots(family, kv_dtype, seed):
    """Logits of a quantized cache that evicts nothing equal the masked full attention over
    round-tripped past keys and values: chunked prefill with left padding, then decode steps."""
    model, ids, mask, chunks = padded_chunked_run(family, seed)
    got, cache = quantized_logits(model, kv_dtype, ids, mask, chunks, slots=24)
    expect = reference_logits(family, seed, kv_dtype, ids, mask, chunks)
    real = mask.bool()
    torch.testing.assert_close(got[real], expect[real], rtol=1e-4, atol=1e-4)
    assert cache.layers[0].keys.dtype == torch.uint8


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_eviction_unchanged_when_the_attention_is_the_same(kv_dtype, seed):
    """Where the attention is the same (keys and values that quantize exactly: every row takes two
    levels, int4 keys two levels in the rotated frame), a quantized cache keeps the float cache's
    slots and scores, decoding past its budget (eviction is unchanged)."""
    cache_f = H2OCache(1, "h2o", 6, max_positions=10_000)
    cache_q = H2OCache(1, "h2o", 6, max_positions=10_000, kv_dtype=kv_dtype)
    turn = spreading_rotation(8) if kv_dtype == "int4" else torch.eye(8)

    def two_levels(shape, low, high):
        x = torch.where(torch.rand(shape) < 0.5, low, high)
        x[..., 0], x[..., 1] = low, high
        return x

    for step in range(16):
        q_len = 4 if step == 0 else 1
        query = torch.randn(2, 4, q_len, 8)
        key = two_levels((2, 2, q_len, 8), -1.0, 1.0) @ turn.T  # (k R = the two-level row)
        value = two_levels((2, 2, q_len, 8), 0.0, 3.0)
        out_f = _drive(cache_f, 0, query, key, value, None, 0.3)
        out_q = _drive(cache_q, 0, query, key, value, None, 0.3)
        torch.testing.assert_close(out_q, out_f, rtol=1e-5, atol=1e-5)
    lf, lq = cache_f.layers[0], cache_q.layers[0]
    assert torch.equal(lf.token_index, lq.token_index)
    torch.testing.assert_close(lq.scores, lf.scores, rtol=1e-5, atol=1e-6)
    assert torch.equal(lq.evicted, lf.evicted)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_renumbering_re_rotates_dequantized_keys(kv_dtype, seed):
    """A re-numbering moves each held key: dequantized, back in the model's frame, RoPE-turned by
    its move, turned and quantized anew (within half the new step of the obvious result); a slot
    whose position does not move keeps its codes."""
    batch, heads, dim = 2, 2, 16
    rotary = Rotary(inv_freq=1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), rotary_dim=dim)
    cache = H2OCache(1, "h2o", 6, max_positions=24, rotary=rotary, kv_dtype=kv_dtype)
    for step in range(30):  # past the 24 positions: at least one re-numbering
        q_len = 4 if step == 0 else 1
        cache.position_ids(batch, q_len)
        _drive(cache, 0, torch.randn(batch, heads, q_len, dim), torch.randn(batch, heads, q_len, dim),
               torch.randn(batch, heads, q_len, dim), None, 0.25)
    assert cache.compactions >= 1
    # one more re-numbering, checked slot by slot
    layer = cache.layers[0]
    positions, keys, codes = layer.positions.clone(), layer.format.keys_and_values(layer.slot_view())[0], layer.keys.clone()
    cache._renumber(span=4)
    delta = (layer.positions - positions).masked_fill(layer.token_index < 0, 0)
    assert bool((delta != 0).any())
    expect = keys.clone()
    rotate_keys(expect, delta, rotary)
    got = layer.format.keys_and_values(layer.slot_view())[0]
    bits = QUANT_BITS[kv_dtype]
    turn = spreading_rotation(dim) if bits == 4 else torch.eye(dim)
    error = ((got - expect) @ turn).abs()
    assert bool((error <= layer.stored["key_scale"].unsqueeze(-1) / 2 + 1e-4).all())
    still = delta == 0
    assert torch.equal(layer.keys[still], codes[still])


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_slots_equal_masked_attention_over_cast_slots(family, seed, monkeypatch):
    """fp8 slots (a cast to float8_e4m3fn, no scales) in a cache that evicts nothing: the logits equal
    the masked full attention over past keys and values cast to float8 and back, chunked prefill with
    left padding then decode steps; a slot costs one byte per channel."""
    model, ids, mask, chunks = padded_chunked_run(family, seed)
    got, cache = quantized_logits(model, "fp8", ids, mask, chunks, slots=24)
    # the reference's past keys and values go through the cast instead of int8 codes
    monkeypatch.setitem(globals(), "roundtrip", lambda x, bits, rotate: x.to(torch.float8_e4m3fn).to(x.dtype))
    expect = reference_logits(family, seed, "int8", ids, mask, chunks)
    real = mask.bool()
    torch.testing.assert_close(got[real], expect[real], rtol=1e-4, atol=1e-4)
    layer = cache.layers[0]
    assert layer.keys.dtype == torch.float8_e4m3fn and "key_scale" not in layer.stored
    assert cache.kv_bytes() == 2 * layer.keys.numel() * len(cache.layers)


def test_fp8_slots_evict_and_select_as_float_slots(seed):
    """Chunks past the budget (the candidates gathered: torch has no float8 gather) and decode
    evictions run in fp8 slots, keeping what float32 slots keep when the keys and values are exact
    in float8 (small integers)."""
    generator = torch.Generator().manual_seed(seed)
    caches = {name: H2OCache(1, "h2o", 6, max_positions=100, kv_dtype=name) for name in ("float32", "fp8")}
    for q_len in (4, 5, 1, 1, 3, 1):
        key = torch.randint(-8, 8, (1, 2, q_len, 8), generator=generator).float()
        value = torch.randint(-8, 8, (1, 2, q_len, 8), generator=generator).float()
        query = torch.randint(-2, 3, (1, 2, q_len, 8), generator=generator).float()
        outs = []
        for cache in caches.values():
            cache.position_ids(1, q_len)
            cache.update(key, value, 0)
            outs.append(cache.attend(0, query, key, value, None, 0.3))
        torch.testing.assert_close(outs[0], outs[1])
    full, fp8 = caches["float32"].layers[0], caches["fp8"].layers[0]
    assert torch.equal(full.token_index, fp8.token_index) and torch.equal(full.keys, fp8.keys.float())
    assert caches["fp8"].evicted_tokens() == caches["float32"].evicted_tokens() > 0


def test_kv_dtype_is_checked():
    with pytest.raises(ValueError, match="--kv-dtype must be one of"):
        H2OCache(1, "h2o", 4, max_positions=100, kv_dtype="int3")


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_float_kv_dtype_casts_the_slots(kv_dtype):
    model = build_model("llama", seed=0)
    ids = torch.randint(3, 90, (1, 10))
    cache = CacheSettings(budget="16", kv_dtype=kv_dtype).build(model)
    forward(model, cache, ids)
    assert cache.layers[0].keys.dtype == getattr(torch, kv_dtype)
    assert cache.kv_bytes() == 2 * cache.layers[0].keys.numel() * 2 * len(cache.layers)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_compiled_quantized_step_equals_eager(monkeypatch, family, kv_dtype, seed):
    """The compiled decode step (aot_eager: the capture inductor gets) of a quantized cache equals
    the eager one, logits and kept slots, past the budget."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    model = build_model(family, seed=seed)
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(seed))
    caches = [CacheSettings(budget="8", kv_dtype=kv_dtype).build(model, static_shapes=static) for static in (False, True)]
    step = compiled.CompiledDecode(model)
    logits = [forward(model, cache, ids)[:, -1] for cache in caches]
    for _ in range(8):
        tokens = logits[0].argmax(-1)
        logits = [forward(model, caches[0], tokens[:, None], logits_to_keep=1)[:, -1], step(caches[1], tokens)]
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
        assert kept_agree_or_tie(*caches, None, "decode")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_a_quantized_row_exports_and_imports(family, kv_dtype, seed):
    """A quantized row (codes, scales and offsets among its state tensors) moved out of a one-row
    cache past its budget and into a row of a batch cache continues as the row alone does; the
    other rows keep every bit; a prefix over the batch's first rows shares the codes and scales."""
    model = build_model(family, seed=seed)
    settings = CacheSettings(budget="8", kv_dtype=kv_dtype)
    generator = torch.Generator().manual_seed(seed)
    single, batch = settings.build(model), settings.build(model)
    forward(model, single, torch.randint(3, 90, (1, 14), generator=generator))
    forward(model, batch, torch.randint(3, 90, (3, 5), generator=generator))
    state = single.export_row(0)
    assert {"keys", "key_scale", "key_offset", "value_scale", "value_offset"} <= set(state.layers[0])
    assert state.layers[0]["keys"].dtype == torch.uint8
    before = [batch.export_row(row) for row in (0, 2)]
    batch.import_row(1, state)
    for row, saved in zip((0, 2), before):
        after = batch.export_row(row)
        assert all(torch.equal(after.layers[i][name], saved.layers[i][name])
                   for i in range(len(saved.layers)) for name in saved.layers[i])
    for _ in range(6):
        tokens = torch.randint(3, 90, (3, 1), generator=generator)
        got = forward(model, batch, tokens, logits_to_keep=1)[:, -1]
        alone = forward(model, single, tokens[1:2], logits_to_keep=1)[:, -1]
        torch.testing.assert_close(got[1:2], alone, rtol=1e-5, atol=1e-5)
    assert single.evicted_tokens() > 0
    prefix = batch.prefix(2)
    for mine, theirs in zip(prefix.layers, batch.layers):
        assert mine.stored["key_scale"].data_ptr() == theirs.stored["key_scale"].data_ptr() and mine.format is theirs.format


def test_set_kv_dtype_in_the_chat():
    """/set kv-dtype int4 is a setting like the others (a new cache); a bad dtype is the user's to fix."""
    from h2ochat.chat.settings import ChatSettings
    from h2ochat.errors import UserError

    changed, name = ChatSettings().with_value("kv-dtype", "int4")
    assert (name, changed.cache.kv_dtype) == ("kv_dtype", "int4")
    with pytest.raises(UserError, match="--kv-dtype must be one of"):
        ChatSettings().with_value("kv-dtype", "int3")
