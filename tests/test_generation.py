"""Sampling and incremental detokenisation against obvious references."""

from __future__ import annotations

import torch

from h2ochat.generation import CacheSettings, Sampling, TextStream, penalize_repeats, sample, stream

from checkpoints import _tokenizer
from conftest import build_model, random_ids


def test_text_stream_pieces_join_to_the_full_decode():
    tokenizer = _tokenizer(300)
    text = "once upon a time — ünïcödé 🐉 there was a dragon\nthe quick brown fox " * 3
    ids = tokenizer(text).input_ids
    pieces = TextStream(tokenizer)
    assert "".join(pieces.push(i) for i in ids) == tokenizer.decode(ids) == pieces.text


def test_greedy_is_argmax_and_filters_keep_only_allowed_tokens():
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


def test_seeded_sampling_repeats_and_stream_stops_at_a_stop_token():
    model = build_model("llama")
    ids = random_ids(1, 6)
    runs = []
    for _ in range(2):
        cache = CacheSettings(budget="8").build(model)
        steps = stream(model, cache, ids, max_new_tokens=12, sampling=Sampling(temperature=1.0, seed=7))
        runs.append([int(s.tokens[0]) for s in steps])
    assert runs[0] == runs[1] and len(runs[0]) == 12
    cache = CacheSettings(budget="8").build(model)
    stop = {runs[0][3]}
    steps = [int(s.tokens[0]) for s in stream(model, cache, ids, max_new_tokens=12,
                                               sampling=Sampling(temperature=1.0, seed=7), stop_ids=stop)]
    assert steps == runs[0][: runs[0].index(runs[0][3]) + 1]


def test_repetition_penalty_follows_the_ctrl_rule_and_stops_repeats():
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
