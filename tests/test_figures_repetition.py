"""The repetition figure never compares a stretch of the story with itself (issue 26, item 17):
two windows when the text holds two, its two halves when shorter, nothing when the halves hold no
n-gram; against a plain string reference of distinct n-grams."""

from __future__ import annotations

import random

import pytest

from h2ochat.measure.textstats import batch_summary, repetition

from seeds import seed  # noqa: F401  (fixture)
from test_repetition import distinct_reference


@pytest.mark.parametrize("length", [0, 3, 7, 8, 9, 50, 599, 600, 601, 2000])
def test_the_two_stretches_never_overlap(seed, length):
    rng = random.Random(seed)
    tokens = [rng.randrange(5) for _ in range(length)]
    window, n = 300, 4
    figures = repetition(tokens, window=window, n=n)
    if length >= 2 * window:
        first, last, halves = tokens[:window], tokens[-window:], False
    else:
        half = length // 2
        first, last, halves = tokens[:half], tokens[length - half:], True
    assert figures.halves == halves and figures.tokens == length
    if len(first) < n:  # not one n-gram in a stretch: no figure at all
        assert (figures.first, figures.last, figures.ratio, figures.window) == (None, None, None, 0)
        assert figures.summary().startswith(f"too short for a repetition figure ({length} tokens")
        assert figures.to_json()["ratio"] is None
        return
    assert figures.window == len(first) == len(last) and len(first) + len(last) <= length  # disjoint
    assert figures.first == pytest.approx(distinct_reference(first, n))
    assert figures.last == pytest.approx(distinct_reference(last, n))
    said = f"distinct 4-grams {figures.first:.2f} in the first {len(first)} tokens, {figures.last:.2f} in the last {len(last)}"
    assert figures.summary().startswith(said)
    assert ("its two halves" in figures.summary()) == halves


def test_a_loop_at_the_end_of_a_short_text_shows():
    """60 tokens, varied then a loop: the old self-comparison (the whole text both times) read 1.0
    against 1.0 here; the halves tell the start from the end."""
    tokens = list(range(100, 130)) + [1, 2] * 15
    figures = repetition(tokens, window=1000)
    assert figures.first == 1.0 and figures.last == pytest.approx(distinct_reference([1, 2] * 15, 4))
    assert figures.ratio < 0.2


def test_several_stories_say_which_stretches_they_compare():
    long, short, tiny = list(range(2000)), list(range(40)), [1, 2]
    same = batch_summary([repetition(long), repetition(long)])
    assert same == "distinct 4-grams in the last 1000 tokens: 1.00 / 1.00 (first 1000: 1.00 / 1.00)"
    mixed = batch_summary([repetition(long), repetition(short), repetition(tiny)])
    assert mixed.startswith("distinct 4-grams at the end: 1.00 / 1.00 / - (at the start: 1.00 / 1.00 / -;")
    assert "halves" in mixed
