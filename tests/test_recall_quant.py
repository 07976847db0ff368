"""Recall with quantized slots (--recall with --kv-dtype int8 / int4) against the masked reference.

The reference is ``MaskedRecall`` (every key kept, the attention masked to hot + staged + recalled
tokens) whose past keys and values are round-tripped through the format the obvious way
(``test_kv_quant.roundtrip``: per token and KV head, int4 keys in the spreading rotation's frame),
the step's own tokens attended at full precision, as the quantized cache attends them. The selector
scores the round-tripped keys, as the real digest scores the dequantized cold keys. All three
families, chunked prefill and decode, compact positions, the compiled step, a parked row.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from conftest import EXACT, VOCAB, build_model, recall_cache

from h2ochat.engine import compiled
from h2ochat.engine.attention import use_h2o_attention
from h2ochat.engine.forward_step import forward
from h2ochat.engine.generation import max_positions
from h2ochat.kv.slot_format import QUANT_BITS
from h2ochat.recall.masked import MaskedRecall
from h2ochat.recall.tiered import RecallConfig
from h2ochat.rotary import find_rotary
from test_kv_quant import roundtrip
from test_recall_cache import _assert_each_token_once, _assert_the_reference_tokens

HOT, RECALL, PAGE = 12, 8, 4
QUANTIZED = ["int8", "int4"]


class RoundTripMasked(MaskedRecall):
    """The masked reference over round-tripped past keys and values (``bits``-bit codes)."""

    def __init__(self, *args, bits: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.bits = bits

    def attend(self, module, query, key, value, scale):
        past = key.shape[2] - query.shape[2]
        key = torch.cat([roundtrip(key[:, :, :past], self.bits, self.bits == 4).to(key.dtype), key[:, :, past:]], 2)
        value = torch.cat([roundtrip(value[:, :, :past], self.bits, False).to(value.dtype), value[:, :, past:]], 2)
        return super().attend(module, query, key, value, scale)

    def _renumber(self, span: int) -> None:
        """A re-numbering moves the round-tripped keys (the real cache turns the dequantized keys and
        quantizes them again: hot ones in place, cold ones when brought back)."""
        if self.rotary is not None:
            with torch.inference_mode():
                for layer in self.cache.layers:
                    layer.keys.copy_(roundtrip(layer.keys, self.bits, self.bits == 4).to(layer.keys.dtype))
        super()._renumber(span)


def _caches(model, kv_dtype, selector, *, limit=None, prefetch=False, **kwargs):
    layers = model.config.num_hidden_layers
    real = recall_cache(layers, "h2o", HOT, recall=RecallConfig(RECALL, PAGE, selector, cold_dtype=EXACT,
                                                                 decode_rule="before" if prefetch else "in-step"),
                        kv_dtype=kv_dtype,
                        max_positions=limit or max_positions(model.config),
                        positions="compact" if limit else "absolute", rotary=find_rotary(model),
                        static_shapes=prefetch, **kwargs)
    masked = RoundTripMasked(layers, "h2o", HOT, RECALL, PAGE, selector, grouping="eviction", staged=True,
                             max_positions=limit, rotary=find_rotary(model) if limit else None, prefetch=prefetch,
                             bits=QUANT_BITS[kv_dtype])
    return real, masked


def _pieces(ids: torch.Tensor, chunked: bool) -> list[torch.Tensor]:
    """A prompt in chunks (or one) then decode steps, a second chunk, more decode steps."""
    first = [ids[:, :10], ids[:, 10:24]] if chunked else [ids[:, :24]]
    return [*first, *[ids[:, i : i + 1] for i in range(24, 44)], ids[:, 44:52],
            *[ids[:, i : i + 1] for i in range(52, ids.shape[1])]]


def _drive(model, real, masked, pieces, atol=2e-4):
    for step, piece in enumerate(pieces):
        MaskedRecall.attach(model)
        want = masked.forward(model, piece)
        use_h2o_attention(model)
        got = forward(model, real, piece, logits_to_keep=1)[:, -1]
        torch.testing.assert_close(got, want, atol=atol, rtol=atol, msg=lambda m: f"step {step}: {m}")
        _assert_the_reference_tokens(real, masked)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("selector", ["exact", "rot4"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunked"])
def test_quantized_recall_is_the_round_tripped_masked_reference(family, seed, kv_dtype, selector, chunked):
    """The same hot, staged, recalled and cold tokens and close logits at every step as the masked
    reference over round-tripped keys and values; pages were recalled in every layer."""
    model = build_model(family, seed=seed, max_position_embeddings=256)
    real, masked = _caches(model, kv_dtype, selector)
    _drive(model, real, masked, _pieces(torch.randint(3, VOCAB, (1, 70)), chunked))
    for layer in real.layers:
        assert layer.keys.dtype == torch.uint8 and "key_scale" in layer.stored  # recall columns: the codes
        assert int(layer.tier.frames.copied.sum()) > 0
        _assert_each_token_once(layer, 0, 70)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_quantized_recall_with_compact_positions(family, seed, kv_dtype):
    """A 56-position limit over 70 tokens re-numbers the held tokens once (the recall and staging
    columns' codes move with the hot ones, the cold store's positions follow, its keys are turned
    when brought back and encoded again): the reference's tokens and logits, the reference's keys
    round-tripped before they move as the real cache's are."""
    model = build_model(family, seed=seed, max_position_embeddings=256)
    real, masked = _caches(model, kv_dtype, "exact", limit=56)
    _drive(model, real, masked, _pieces(torch.randint(3, VOCAB, (1, 70)), True), atol=1e-3)
    assert masked.compactions == real.compactions == 1


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_recalled_pages_hold_the_codes_the_slots_held(kv_dtype):
    """A token brought back from the cold store holds the codes and scales its slot held when it was
    evicted (the cold store keeps their floats: encoding them again gives the same bytes)."""
    model = build_model("llama", seed=0, max_position_embeddings=256)
    real, _ = _caches(model, kv_dtype, "exact")
    use_h2o_attention(model)
    ids = torch.randint(3, VOCAB, (1, 60))
    seen: dict[tuple[int, int, int], tuple] = {}  # (layer, head, token) -> its codes and scales while hot
    for piece in _pieces(ids, False):
        for index, layer in enumerate(real.layers if real.initialized else []):
            for head in range(layer.keys.shape[1]):
                for slot, token in enumerate(layer.token_index[0, head, : layer.capacity].tolist()):
                    if token >= 0:
                        seen[index, head, token] = (layer.keys[0, head, slot].clone(), layer.stored["key_scale"][0, head, slot].item(),
                                                    layer.values[0, head, slot].clone())
        forward(model, real, piece)
    compared = 0
    for index, layer in enumerate(real.layers):
        tier = layer.tier
        for head in range(layer.keys.shape[1]):
            for column, token in enumerate(tier.slots.token_index[0, head].tolist()):
                if token >= 0 and (index, head, token) in seen:
                    keys, key_scale, values = seen[index, head, token]
                    assert (tier.slots.keys[0, head, column].int() - keys.int()).abs().max() <= 1
                    assert (tier.slots.values[0, head, column].int() - values.int()).abs().max() <= 1
                    assert tier.slots.scales["key_scale"][0, head, column].item() == pytest.approx(key_scale, rel=1e-4)
                    compared += 1
    assert compared > 0


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_compiled_quantized_recall_is_eager(kv_dtype):
    """The compiled decode step (aot_eager; its graph chooses pages with the step's own queries) with
    quantized recall columns: two rows, 24 decode steps that stage, flush, recall and re-number at
    a 48-position limit, the eager step's logits and state tensors exactly, in one graph."""
    model = build_model("llama", seed=0, max_position_embeddings=256)
    caches = [recall_cache(model.config.num_hidden_layers, "h2o", HOT, recall=RecallConfig(RECALL, PAGE, "rot4"),
                           kv_dtype=kv_dtype, max_positions=48, rotary=find_rotary(model), static_shapes=True)
              for _ in range(2)]
    use_h2o_attention(model)
    ids = torch.randint(3, VOCAB, (2, 54))
    eager, fast = caches
    forward(model, eager, ids[:, :30]), forward(model, fast, ids[:, :30])
    step = compiled.CompiledDecode(model, backend="aot_eager")
    assert step.prepare(fast)
    graphs = counters["stats"]["unique_graphs"]
    for column in range(30, 54):  # the compiled step takes the tokens [B], the eager forward [B, 1]
        expected = forward(model, eager, ids[:, column : column + 1], logits_to_keep=1)[:, -1]
        assert torch.equal(step(fast, ids[:, column]), expected), f"token {column}"
    for eager_layer, compiled_layer in zip(*(cache.layers for cache in caches)):
        for name, tensor in eager_layer.state_tensors().items():
            assert torch.equal(compiled_layer.state_tensors()[name], tensor), name
        assert int(compiled_layer.tier.frames.copied.sum()) > 0
    assert caches[1].compactions == caches[0].compactions >= 1
    assert counters["stats"]["unique_graphs"] - graphs == 1


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_a_parked_quantized_row_resumes_with_its_cold_tier(family, kv_dtype):
    """A row exported mid-conversation (codes, scales, cold store, digest) and imported into another
    cache's row continues as the original does."""
    model = build_model(family, seed=0, max_position_embeddings=256)
    ids = torch.randint(3, VOCAB, (1, 60))
    original, _ = _caches(model, kv_dtype, "rot4")
    use_h2o_attention(model)
    for piece in [ids[:, :24], *[ids[:, i : i + 1] for i in range(24, 40)]]:
        forward(model, original, piece)
    state = original.export_row(0)
    moved, _ = _caches(model, kv_dtype, "rot4")
    forward(model, moved, torch.randint(3, VOCAB, (1, 30)))  # (its row held another conversation)
    moved.import_row(0, state)
    assert int(moved.layers[0].tier.cold.count.max()) > 0
    for i in range(40, 60):
        want = forward(model, original, ids[:, i : i + 1])[:, -1]
        got = forward(model, moved, ids[:, i : i + 1])[:, -1]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
