"""How repetitive a long text is: distinct n-grams at its start against its end.

A model that degenerates over a long story starts repeating phrases: the share of distinct
4-grams among all 4-grams of a stretch of text falls. Comparing the last stretch with the first
shows that as a number (near 1.0 = varied text; a loop of a few phrases approaches 0).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

DEFAULT_WINDOW = 1000
DEFAULT_N = 4


def distinct_ngrams(tokens: Sequence[int], n: int = DEFAULT_N) -> float:
    """Distinct n-grams / all n-grams of ``tokens`` (1.0 when there are none)."""
    total = len(tokens) - n + 1
    if total <= 0:
        return 1.0
    return len({tuple(tokens[i : i + n]) for i in range(total)}) / total


@dataclass
class Repetition:
    n: int
    window: int  # tokens in each stretch compared (0: too short to compare)
    first: float | None  # distinct n-gram share over the first stretch (None: too short)
    last: float | None  # ... and over the last, never overlapping the first
    tokens: int  # tokens measured
    halves: bool = False  # shorter than two windows: the two halves were compared

    @property
    def ratio(self) -> float | None:
        """last / first: 1.0 = as varied at the end as at the start (None: too short to say)."""
        if self.first is None or self.last is None:
            return None
        return self.last / self.first if self.first else 0.0

    def to_json(self) -> dict:
        def rounded(value):
            return None if value is None else round(value, 4)

        return {**asdict(self), "ratio": rounded(self.ratio), "first": rounded(self.first), "last": rounded(self.last)}

    def summary(self) -> str:
        if self.first is None:
            return (f"too short for a repetition figure ({self.tokens} tokens: two stretches of at least "
                    f"{self.n} are compared)")
        text = (f"distinct {self.n}-grams {self.first:.2f} in the first {self.window} tokens, "
                f"{self.last:.2f} in the last {self.window}")
        return text + (" (its two halves: shorter than two windows)" if self.halves else "")


def batch_summary(checks: Sequence[Repetition]) -> str:
    """One line for the figures of several stories (a story too short to compare shows as -)."""
    def figures(which: str) -> str:
        return " / ".join("-" if getattr(c, which) is None else f"{getattr(c, which):.2f}" for c in checks)

    windows = {c.window for c in checks if c.first is not None}
    if len(windows) == 1 and not any(c.halves for c in checks):
        window = windows.pop()
        return f"distinct {checks[0].n}-grams in the last {window} tokens: {figures('last')} (first {window}: {figures('first')})"
    return (f"distinct {checks[0].n}-grams at the end: {figures('last')} (at the start: {figures('first')}; the two "
            "halves of a story shorter than two windows, - too short)")


def repetition(tokens: Sequence[int], window: int = DEFAULT_WINDOW, n: int = DEFAULT_N) -> Repetition:
    """Distinct n-gram shares of the first and last ``window`` tokens. The two never overlap (a
    stretch compared with itself says nothing): a text shorter than two windows compares its halves,
    one whose halves hold fewer than ``n`` tokens each gets no figure."""
    tokens = list(tokens)
    halves = len(tokens) < 2 * window
    stretch = len(tokens) // 2 if halves else window
    if stretch < n:
        return Repetition(n=n, window=0, first=None, last=None, tokens=len(tokens), halves=halves)
    return Repetition(n=n, window=stretch, first=distinct_ngrams(tokens[:stretch], n),
                      last=distinct_ngrams(tokens[len(tokens) - stretch :], n), tokens=len(tokens), halves=halves)
