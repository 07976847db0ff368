"""Ways to drive the H2O cache wrong, each refused with a clear error rather than silently attending
the wrong tokens, and the prefill's chunking, counted forward by forward.

- An H2OCache given to a model that runs another attention (sdpa) raises, under model(...),
  generation.forward and transformers' generate().
- Keys that change between cache.update and the attention (a hook that copies them) raise.
- Right padding raises, through model(...), h2ochat's prefill and generate(); left padding longer
  than a prefill chunk is still served.
- Prefill caps a chunk only where a re-numbering is due; a budget of the whole window, which can
  never re-number, is refused at the limit with one line through the CLI.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AttentionInterface

from h2ochat.engine.attention import h2o_attention
from h2ochat.kv import AttentionMismatchError, H2OCache, PositionLimitError
from h2ochat.engine.generation import CacheSettings, forward, prefill

from conftest import FAMILIES, build_model, random_ids
from test_generate_cli import assert_one_line_error, h2ochat_main  # noqa: F401  (a fixture)


def greedy(**extra):
    return dict(max_new_tokens=4, do_sample=False, **extra)


# -- an H2OCache under another attention ------------------------------------------------------------

def test_an_sdpa_model_given_an_h2o_cache_raises(family, seed):
    model = build_model(family, attn="sdpa")
    ids = random_ids(2, 6)
    cache = CacheSettings(budget="8").build(model)
    with pytest.raises(AttentionMismatchError, match="never reached the h2o attention"), torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
    with pytest.raises(AttentionMismatchError, match="never reached the h2o attention"):
        model.generate(ids, cache=CacheSettings(budget="8").build(model), pad_token_id=0, **greedy())
    with pytest.raises(AttentionMismatchError, match="runs 'sdpa' attention"):  # before anything runs
        forward(model, CacheSettings(budget="8").build(model), ids)


def test_a_one_layer_sdpa_model_raises_at_its_next_forward(seed):
    """With one layer there is no next layer to notice: the next forward's first update does."""
    model = build_model("llama", attn="sdpa", num_hidden_layers=1)
    cache = CacheSettings(budget="8").build(model)
    with torch.inference_mode():
        model(random_ids(1, 4), cache=cache, use_cache=True)
        with pytest.raises(AttentionMismatchError):
            model(random_ids(1, 1), cache=cache, use_cache=True)


def cloning_attention(module, query, key, value, *args, **kwargs):
    """A stand-in for a hook that copies the keys between cache.update and the attention."""
    return h2o_attention(module, query, key.clone(), value, *args, **kwargs)


@pytest.mark.parametrize("path", ["forward", "generate"])
def test_keys_copied_between_update_and_attention_raise(family, path, monkeypatch, seed):
    model = build_model(family)
    monkeypatch.setitem(AttentionInterface._global_mapping, "h2o", cloning_attention)
    ids = random_ids(2, 5)
    cache = CacheSettings(budget="8").build(model)
    with pytest.raises(AttentionMismatchError, match="not the ones cache.update received"):
        if path == "forward":
            forward(model, cache, ids)
        else:
            model.generate(ids, cache=cache, pad_token_id=0, **greedy())


def test_a_cache_whose_update_returns_copies_raises(family, monkeypatch, seed):
    """The other side of the hand-over: a wrapper around the cache that returns copies."""
    model = build_model(family)
    update = H2OCache.update

    def copying(self, key, value, *args, **kwargs):
        key, value = update(self, key, value, *args, **kwargs)
        return key.clone(), value.clone()

    monkeypatch.setattr(H2OCache, "update", copying)
    ids = random_ids(1, 5)
    with pytest.raises(AttentionMismatchError):
        forward(model, CacheSettings(budget="8").build(model), ids)
    with pytest.raises(AttentionMismatchError):
        model.generate(ids, cache=CacheSettings(budget="8").build(model), pad_token_id=0, **greedy())


# -- padding ----------------------------------------------------------------------------------------

def right_padded(batch=2, length=8, pad_tail=3):
    ids = random_ids(batch, length)
    mask = torch.ones_like(ids)
    mask[1, -pad_tail:] = 0
    return ids, mask


def test_right_padding_is_refused_through_forward_prefill_and_generate(family, seed):
    model = build_model(family)
    ids, mask = right_padded()
    message = "right-padded batches are not supported"
    with pytest.raises(ValueError, match=message), torch.inference_mode():
        model(ids, attention_mask=mask, cache=CacheSettings(budget="8").build(model), use_cache=True)
    with pytest.raises(ValueError, match=message):
        forward(model, CacheSettings(budget="8").build(model), ids, mask)
    for chunk in (3, 5, 512):  # 5: the padding is a chunk of its own, which alone looks like left padding
        with pytest.raises(ValueError, match=message):
            prefill(model, CacheSettings(budget="8").build(model), ids, mask, chunk=chunk)
    with pytest.raises(ValueError, match=message):
        model.generate(ids, attention_mask=mask, cache=CacheSettings(budget="8").build(model), pad_token_id=0,
                       **greedy())


def test_left_padding_longer_than_a_prefill_chunk_equals_each_sequence_alone(family, seed):
    """A row that is all padding within a chunk is left padding, not right padding: served, and
    each row ends as it would alone."""
    model = build_model(family)
    pad = model.config.pad_token_id
    long, short = random_ids(1, 11)[0], random_ids(1, 4)[0]
    ids = torch.full((2, 11), pad)
    mask = torch.zeros(2, 11, dtype=torch.long)
    ids[0], mask[0] = long, 1
    ids[1, 7:], mask[1, 7:] = short, 1  # 7 padding tokens: chunks of 3 are all padding twice
    follow = random_ids(2, 10)
    settings = CacheSettings(budget="6")
    cache = settings.build(model)
    batched = [prefill(model, cache, ids, mask, chunk=3)]
    batched += [forward(model, cache, follow[:, t : t + 1])[:, -1] for t in range(follow.shape[1])]
    for row, prompt in enumerate((long, short)):
        alone_cache = settings.build(model)
        alone = [prefill(model, alone_cache, prompt[None], chunk=3)]
        alone += [forward(model, alone_cache, follow[row : row + 1, t : t + 1])[:, -1] for t in range(follow.shape[1])]
        for step, (b, a) in enumerate(zip(batched, alone)):
            torch.testing.assert_close(b[row], a[0], rtol=1e-5, atol=1e-5, msg=lambda m: f"row {row} step {step}: {m}")
    assert cache.evicted_tokens() > 0


# -- prefill chunks -----------------------------------------------------------------------------------

@pytest.fixture
def forwards(monkeypatch):
    """The number of new tokens of every model forward, in order."""
    sizes: list[int] = []

    def counting(model):
        model.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[1]),
                                        with_kwargs=True)
        return model

    return sizes, counting


@pytest.mark.parametrize("budget", ["1.0", "2000", "256"])
def test_a_prompt_far_from_the_limit_is_fed_in_full_chunks(family, budget, forwards, seed):
    """2048 positions, a 300-token prompt in chunks of 64: ceil(300/64) forwards whatever the budget
    (a cap at max_positions - slots fed a budget of 1.0 one token per forward)."""
    sizes, counting = forwards
    model = counting(build_model(family, max_position_embeddings=2048))
    cache = CacheSettings(budget=budget).build(model)
    prefill(model, cache, random_ids(1, 300), chunk=64)
    assert len(sizes) == math.ceil(300 / 64) and sizes == [64, 64, 64, 64, 44]
    assert cache.compactions == 0 and cache.longest_row_tokens() == 300


@pytest.mark.parametrize("length,chunk,expected,compactions", [
    # 64 positions, 16 slots. Chunks of 20: three fit, the fourth stops at the limit (4), the cache
    # re-numbers to 0..15 and a full chunk follows.
    (100, 20, [20, 20, 20, 4, 20, 16], 1),
    # Chunks of 60: after re-numbering only 64 - 16 = 48 fit beside the slots.
    (150, 60, [60, 4, 48, 38], 2),
])
def test_a_chunk_is_split_where_a_renumbering_is_due(family, length, chunk, expected, compactions, forwards, seed):
    sizes, counting = forwards
    model = counting(build_model(family))  # max_position_embeddings = 64
    cache = CacheSettings(budget="16").build(model)
    prefill(model, cache, random_ids(1, length), chunk=chunk)
    assert sizes == expected and sum(sizes) == length
    assert cache.compactions == compactions and cache.longest_row_tokens() == length
    for layer in cache.layers:
        assert int(layer.positions.max()) < 64


def test_a_budget_of_the_whole_window_stops_at_the_limit(family, seed):
    model = build_model(family)  # 64 positions
    cache = CacheSettings(budget="1.0").build(model)
    prefill(model, cache, random_ids(1, 50))
    token = random_ids(1, 1)
    with pytest.raises(PositionLimitError, match="use a smaller --budget"):
        for _ in range(20):
            token = forward(model, cache, token)[:, -1:].argmax(-1)
    assert cache.longest_row_tokens() == 64  # it went right up to the limit
    with pytest.raises(PositionLimitError, match="use a smaller --budget"):
        prefill(model, CacheSettings(budget="1.0").build(model), random_ids(1, 100), chunk=30)


@pytest.mark.parametrize("prompt_words,new_tokens", [(3, 80), (120, 4)], ids=["generation", "prompt"])
def test_budget_one_past_the_limit_is_one_line_through_the_cli(tiny_checkpoint, h2ochat_main, prompt_words,  # noqa: F811
                                                                new_tokens):
    prompt = " ".join(["the quick brown fox"] * prompt_words)
    # --ignore-eos: the random model must not end its text before it reaches the limit
    result = h2ochat_main("generate", prompt, "--model", str(tiny_checkpoint), "--budget", "1.0", "--raw",
                          "-n", str(new_tokens), "--ignore-eos")
    assert_one_line_error(result, "64 positions", "use a smaller --budget")
    result = h2ochat_main("generate", prompt, "--model", str(tiny_checkpoint), "--budget", "0.5", "--raw",
                          "-n", str(new_tokens), "--json", "--ignore-eos")
    assert result.returncode == 0, result.stderr
