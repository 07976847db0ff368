"""Reading --budget: a fraction of the context window or a number of slots."""

from __future__ import annotations


def parse_budget(text: str | float | int, max_positions: int) -> int:
    """Slots per (layer, sequence, KV head) for a --budget value.

    A value written with a decimal point or exponent ("0.2", "1.0", "1e-1") is a fraction in
    (0, 1] of the model's context window; a plain integer ("512", "1") is a number of slots.
    So "1.0" is the whole window and "1" is a single slot.
    """
    raw = str(text).strip()
    is_fraction = any(ch in raw for ch in ".eE")
    try:
        value = float(raw) if is_fraction else int(raw)
    except ValueError:
        raise ValueError(f"--budget must be a fraction like 0.2 or a slot count like 512, got {raw!r}") from None
    if is_fraction:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"--budget as a fraction must be in (0, 1], got {raw}")
        return max(1, round(value * max_positions))
    if value < 1:
        raise ValueError(f"--budget as a slot count must be at least 1, got {raw}")
    return value
