"""Sampling and incremental detokenisation against obvious references; transformers' generate()
with an evicting H2OCache against h2ochat's own loop."""

from __future__ import annotations

import pytest
import torch

from h2ochat.detokenize import TextStream
from h2ochat.generation import CacheSettings, Sampling, penalize_repeats, sample, stream

from checkpoints import _tokenizer
from conftest import build_model, random_ids


def test_text_stream_pieces_join_to_the_full_decode():
    tokenizer = _tokenizer(300)
    text = "once upon a time — ünïcödé 🐉 there was a dragon\nthe quick brown fox " * 3
    ids = tokenizer(text).input_ids
    pieces = TextStream(tokenizer)
    assert "".join(pieces.push(i) for i in ids) == tokenizer.decode(ids) == pieces.text


def test_greedy_is_argmax_and_filters_keep_only_allowed_tokens(seed):
    logits = torch.randn(64, 50)
    assert torch.equal(sample(logits, Sampling()), logits.argmax(-1))
    top_k = sample(logits, Sampling(temperature=1.0, top_k=3))
    allowed = logits.topk(3, dim=-1).indices
    assert (allowed == top_k[:, None]).any(-1).all()
    top_p = sample(logits, Sampling(temperature=0.7, top_p=0.5))
    probs = logits.softmax(-1)
    for row, token in enumerate(top_p.tolist()):  # the nucleus: tokens whose better-ranked mass is < p
        better = probs[row][probs[row] > probs[row, token]].sum()
        assert better < 0.5


def test_seeded_sampling_repeats_and_stream_stops_at_a_stop_token(seed):
    model = build_model("llama")
    ids = random_ids(1, 6)
    runs = []
    for _ in range(2):
        cache = CacheSettings(budget="8").build(model)
        steps = stream(model, cache, ids, max_new_tokens=12, sampling=Sampling(temperature=1.0, seed=seed))
        runs.append([int(s.tokens[0]) for s in steps])
    assert runs[0] == runs[1] and len(runs[0]) == 12
    cache = CacheSettings(budget="8").build(model)
    stop = {runs[0][3]}
    steps = [int(s.tokens[0]) for s in stream(model, cache, ids, max_new_tokens=12,
                                               sampling=Sampling(temperature=1.0, seed=seed), stop_ids=stop)]
    assert steps == runs[0][: runs[0].index(runs[0][3]) + 1]


def test_repetition_penalty_follows_the_ctrl_rule_and_stops_repeats(seed):
    logits = torch.randn(3, 20)
    seen = torch.rand(3, 20) < 0.4
    got = penalize_repeats(logits, seen, 1.3)
    for row in range(3):
        for token in range(20):
            x = float(logits[row, token])
            want = (x / 1.3 if x > 0 else x * 1.3) if seen[row, token] else x
            assert abs(float(got[row, token]) - want) < 1e-6
    model = build_model("llama")
    prompt = random_ids(1, 5)
    cache = CacheSettings(budget="8").build(model)
    steps = stream(model, cache, prompt, max_new_tokens=30, sampling=Sampling(repetition_penalty=1e6))
    generated = [int(s.tokens[0]) for s in steps]
    assert len(set(generated)) == 30 and not set(generated) & set(prompt[0].tolist())  # nothing said twice


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_generate_with_an_evicting_cache_matches_h2ochats_loop(family, temperature, seed):
    """transformers' generate() driving an H2OCache that evicts from the first new token (8 slots, a
    10-token prompt, one row left-padded) picks the tokens h2ochat's own loop picks with the same
    settings and seed, and leaves the cache holding the same tokens with the same scores. Under
    generate() the attention finds its layer without h2ochat's keyword (OPT and Llama through the
    keyword dict they share with cache.update, GPT-NeoX through the last update): a wrong layer
    changes the kept tokens."""
    model = build_model(family)
    model.generation_config.eos_token_id = None  # generate() would stop a row at a sampled EOS; stream() runs on
    pad = model.config.pad_token_id
    ids = random_ids(2, 10)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = pad, 0
    new_tokens = 20
    settings = CacheSettings(budget="8")
    ours = settings.build(model)
    sampling = Sampling(temperature=temperature, seed=seed)
    expected = torch.stack([s.tokens for s in stream(model, ours, ids, mask, max_new_tokens=new_tokens,
                                                     sampling=sampling)], dim=1)
    theirs = settings.build(model)
    options = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)
    torch.manual_seed(seed)  # generate() samples from the global generator; stream() from one seeded alike
    got = model.generate(ids, attention_mask=mask, cache=theirs, max_new_tokens=new_tokens, pad_token_id=pad, **options)
    assert torch.equal(got[:, ids.shape[1]:], expected)
    assert theirs.evicted_tokens() == ours.evicted_tokens() > 0
    for layer_idx, (a, b) in enumerate(zip(theirs.layers, ours.layers)):
        order_a, order_b = a.token_index.argsort(-1), b.token_index.argsort(-1)
        assert torch.equal(a.token_index.gather(2, order_a), b.token_index.gather(2, order_b)), f"layer {layer_idx}"
        torch.testing.assert_close(a.scores.gather(2, order_a), b.scores.gather(2, order_b), rtol=1e-5, atol=1e-6)
