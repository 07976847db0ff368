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
    window: int  # tokens in each stretch compared
    first: float  # distinct n-gram share over the first `window` generated tokens
    last: float  # ... and over the last `window`
    tokens: int  # tokens measured

    @property
    def ratio(self) -> float:
        """last / first: 1.0 = as varied at the end as at the start."""
        return self.last / self.first if self.first else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": round(self.ratio, 4), "first": round(self.first, 4),
                "last": round(self.last, 4)}

    def summary(self) -> str:
        return (f"distinct {self.n}-grams {self.first:.2f} in the first {self.window} tokens, "
                f"{self.last:.2f} in the last {self.window}")


def repetition(tokens: Sequence[int], window: int = DEFAULT_WINDOW, n: int = DEFAULT_N) -> Repetition:
    """Distinct n-gram shares of the first and last ``window`` tokens (they overlap in a text shorter
    than two windows; the whole text when shorter than one)."""
    tokens = list(tokens)
    window = max(min(window, len(tokens)), 0)
    return Repetition(n=n, window=window, first=distinct_ngrams(tokens[:window], n),
                      last=distinct_ngrams(tokens[len(tokens) - window :], n), tokens=len(tokens))
