"""Sampling and incremental detokenisation against obvious references; transformers' generate()
with an evicting H2OCache against h2ochat's own loop."""

from __future__ import annotations

import pytest
import torch

from h2ochat.engine.detokenize import TextStream
from h2ochat.engine.generation import CacheSettings, Sampling, Timing, penalize_repeats, prefill, sample, stream

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
        # under generate() the cache numbers each step when its first layer attends: the same positions
        assert torch.equal(a.positions.gather(2, order_a), b.positions.gather(2, order_b)), f"layer {layer_idx}"
        torch.testing.assert_close(a.scores.gather(2, order_a), b.scores.gather(2, order_b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("leaves_rows_out", [True, False], ids=["h2o", "cannot-leave-rows-out"])
def test_stream_counts_the_tokens_it_fed_past_a_stop(seed, monkeypatch, leaves_rows_out):
    """With stop_check_every = k > 1 the stop is read back once per k tokens. A cache that cannot leave
    the finished row out of the steps queued after the stop (``masks_inactive_rows`` False: the recall
    tier) has been fed the tokens after the stop in that burst: the timing counts them, and the run
    record reports them as fed past the stop, not as generated text (the "generated" part ends at the
    last token fed before the stop). An H2OCache is fed nothing past the stop."""
    from types import SimpleNamespace

    from h2ochat.kv import H2OCache
    from h2ochat.chat.report import run_record

    if not leaves_rows_out:
        monkeypatch.setattr(H2OCache, "masks_inactive_rows", property(lambda self: False))
    model = build_model("llama")
    prompt = random_ids(1, 6)
    settings = CacheSettings(policy="h2o", budget="8")
    free = [int(s.tokens[0]) for s in stream(model, settings.build(model), prompt, max_new_tokens=12)]
    stop_token = free[5]
    stop_at = free.index(stop_token)
    burst_end = min((stop_at // 4 + 1) * 4 - 1, 11)  # the last step of the burst holding the stop
    if leaves_rows_out:
        burst_end = stop_at  # the steps after the stop fed nobody
    timing, cache = Timing(), settings.build(model)
    got = [int(s.tokens[0]) for s in stream(model, cache, prompt, max_new_tokens=12, stop_ids={stop_token},
                                            timing=timing, stop_check_every=4)]
    assert got == free[: stop_at + 1]
    assert timing.generated_tokens == stop_at + 1
    assert timing.fed_past_stop == burst_end - stop_at
    assert cache.longest_row_tokens() == 6 + burst_end  # every step up to the burst's end fed its previous token
    loaded = SimpleNamespace(name="tiny", device=torch.device("cpu"), dtype=torch.float32)
    record = run_record(loaded, cache, timing, "8", "")
    assert record["tokens_fed"] == 6 + burst_end and record["tokens_fed_past_stop"] == burst_end - stop_at
    generated = next(p for p in record["cache_stats"]["parts"] if p["name"] == "generated")
    assert generated["tokens"] == stop_at  # the stop token itself is never fed


def test_reset_leaves_nothing_of_the_last_conversation(family, seed):
    """After reset() the cache behaves as a new one: same logits, and the cache-level state (the
    re-numbering count, the position bound, the row counters, a step in progress) starts over."""
    model = build_model(family)
    settings = CacheSettings(policy="h2o", budget="8")
    used = settings.build(model)
    prefill(model, used, random_ids(2, 90), chunk=16)  # past the 64-position limit: re-numbered
    assert used.compactions > 0 and used.largest_next_position > 0
    used.static_addresses_marked = True  # as a CUDA-graph step would have left it: the new slots are not marked
    used.reset()
    assert (used.compactions, used.largest_next_position, used.tokens_fed, used.step, used.pending) == (0, 0, None, None, None)
    assert not used.static_addresses_marked
    assert not used.initialized and used.kv_bytes() == 0
    fresh = settings.build(model)
    ids = random_ids(1, 70)
    torch.testing.assert_close(prefill(model, used, ids, chunk=16), prefill(model, fresh, ids, chunk=16))
    assert (used.compactions, used.largest_next_position, used.longest_row_tokens()) == (
        fresh.compactions, fresh.largest_next_position, fresh.longest_row_tokens())
