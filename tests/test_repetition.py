"""The repetition penalty's window and the repetition figure `story` reports, against plain references."""

from __future__ import annotations

import random

import pytest
import torch

from h2ochat.engine.generation import CacheSettings, Sampling, penalize_repeats, stream
from h2ochat.engine.repetition import RecentTokens
from h2ochat.measure.textstats import distinct_ngrams, repetition

from conftest import build_model, random_ids
from seeds import seed  # noqa: F401  (fixture)


def window_reference(text: list[int], window: int, vocab: int) -> torch.Tensor:
    """[V] bool: the tokens among the last `window` of `text` (all of it for 0 / -1)."""
    recent = text if window <= 0 else text[-window:] if window <= len(text) else text
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[list(recent)] = True
    return mask


@pytest.mark.parametrize("window", [-1, 0, 1, 5, 17])
def test_recent_tokens_hold_exactly_the_last_n(seed, window):
    vocab, batch = 23, 3
    lengths = [random.randint(1, 30) for _ in range(batch)]
    width = max(lengths)
    ids = torch.randint(0, vocab, (batch, width))
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, length in enumerate(lengths):  # left padding, as a batch of prompts gets
        mask[row, width - length:] = 1
    texts = [ids[row, width - length:].tolist() for row, length in enumerate(lengths)]
    recent = RecentTokens(ids, mask, vocab, window)
    for _ in range(40):
        for row in range(batch):
            assert torch.equal(recent.mask()[row], window_reference(texts[row], window, vocab)), (row, texts[row])
        new = torch.randint(0, vocab, (batch,))
        recent.push(new)
        for row in range(batch):
            texts[row].append(int(new[row]))


def test_penalty_at_every_step_comes_from_the_last_n_tokens_only(seed, monkeypatch):
    """Each step's sampling sees the CTRL penalty applied to exactly the tokens among the last N of
    prompt + generated text, and greedy decoding picks the argmax of those penalised logits."""
    import h2ochat.engine.generation as generation

    window, penalty = 6, 3.0
    model = build_model("llama", seed=seed)
    prompt = random_ids(1, 9)
    seen_by_step = []
    real_sample = generation.sample

    def spy(logits, sampling, generator=None, seen=None):
        seen_by_step.append((logits.clone(), seen.mask().clone()))
        return real_sample(logits, sampling, generator, seen)

    monkeypatch.setattr(generation, "sample", spy)
    cache = CacheSettings(budget="8").build(model)
    sampling = Sampling(repetition_penalty=penalty, repeat_last_n=window)
    generated = [int(step.tokens[0]) for step in stream(model, cache, prompt, max_new_tokens=25, sampling=sampling)]
    text = prompt[0].tolist()
    vocab = model.config.vocab_size
    for (logits, mask), token in zip(seen_by_step, generated):
        reference = window_reference(text, window, vocab)
        assert torch.equal(mask[0], reference)
        manual = logits[0].clone()
        manual[reference] = torch.where(manual[reference] > 0, manual[reference] / penalty, manual[reference] * penalty)
        assert token == int(manual.argmax())
        text.append(token)


def test_unbounded_and_windowed_penalties_differ_only_past_the_window(seed):
    logits = torch.randn(2, 40)
    text = [random.randrange(40) for _ in range(30)]
    ids = torch.tensor([text, text])
    whole = penalize_repeats(logits, RecentTokens(ids, None, 40, 0), 1.5)
    last = penalize_repeats(logits, RecentTokens(ids, None, 40, 10), 1.5)
    only_old = sorted(set(text[:20]) - set(text[20:]))
    changed = (whole != last).any(0).nonzero().flatten().tolist()
    assert changed == only_old


def test_sampling_refuses_a_negative_window():
    with pytest.raises(ValueError, match="repeat_last_n"):
        Sampling(repeat_last_n=-2).validate()


def distinct_reference(tokens: list[int], n: int) -> float:
    grams = [" ".join(map(str, tokens[i:i + n])) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def test_distinct_ngrams_match_a_string_reference(seed):
    for _ in range(20):
        vocab = random.randint(2, 12)
        tokens = [random.randrange(vocab) for _ in range(random.randint(0, 200))]
        n = random.randint(1, 5)
        assert distinct_ngrams(tokens, n) == pytest.approx(distinct_reference(tokens, n))


def test_repetition_compares_the_first_and_last_windows(seed):
    varied = list(range(1000, 1400))  # no 4-gram repeats
    loop = [7, 8, 9] * 200  # a three-token loop: 3 distinct 4-grams
    figures = repetition(varied + loop, window=300)
    assert figures.first == 1.0
    assert figures.last == pytest.approx(3 / 297)
    assert figures.ratio == pytest.approx(3 / 297)
    short = repetition(varied[:50], window=300)  # shorter than two windows: its halves (tests/test_figures_repetition.py)
    assert (short.window, short.first, short.last, short.halves) == (25, 1.0, 1.0, True)
