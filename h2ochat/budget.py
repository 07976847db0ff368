"""Reading --budget: a fraction of the context window or a number of slots."""

from __future__ import annotations

from .sizes import parse_fraction


def parse_budget(text: str | float | int, max_positions: int) -> int:
    """Slots per (layer, sequence, KV head) for a --budget value.

    A value written with a decimal point or exponent ("0.2", "1.0", "1e-1") is a fraction in
    (0, 1] of the model's context window; a plain integer ("512", "1") is a number of slots.
    So "1.0" is the whole window and "1" is a single slot.
    """
    return parse_fraction(text, "--budget", max_positions)
