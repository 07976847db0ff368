"""Reading amounts the user types: a share or a count (--budget, --recall) and a byte size (--kv-memory,
--budget 16MiB).

One reader for the whole product, so "1e-1" means the same to --budget as to --recall, and a size
means the same to bench as to serve. No torch here: these run before anything heavy is imported.
"""

from __future__ import annotations

import math
import re


def parse_share_or_count(text: str | float | int, option: str) -> float | int:
    """A share written with a decimal point or an exponent ("0.2", "1.0", "1e-1") as a float, a
    whole number ("512", "1") as an int. So "1.0" is a share (all of it) and "1" is one.
    ValueError naming ``option`` for anything else; the range is the caller's to check."""
    raw = str(text).strip()
    is_share = any(ch in raw for ch in ".eE")
    try:
        value = float(raw) if is_share else int(raw)
    except ValueError:
        raise ValueError(f"{option} must be a share like 0.2 or a count like 512, got {raw!r}") from None
    if is_share and not math.isfinite(value):
        raise ValueError(f"{option} must be a share like 0.2 or a count like 512, got {raw!r}")
    return value


def parse_fraction(text: str | float | int, option: str, whole: int) -> int:
    """``parse_share_or_count`` turned into a count: a share in (0, 1] of ``whole`` (at least 1), or
    the count as written (at least 1)."""
    value = parse_share_or_count(text, option)
    raw = str(text).strip()
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{option} as a share must be in (0, 1], got {raw}")
        return max(1, round(value * whole))
    if value < 1:
        raise ValueError(f"{option} as a count must be at least 1, got {raw}")
    return value


_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*", re.IGNORECASE)


def parse_size(text: str, option: str = "--kv-memory") -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes (KiB... are powers of 1024, kB... of 1000)."""
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise ValueError(f"{option} must be a size like 2GiB, 512MiB or 1.5GB, got {text!r}")
    number, unit, binary = match.groups()
    base = 1024 if binary or not unit else 1000
    value = float(number) * base ** "_kmgt".index(unit.lower() or "_")
    if value <= 0:
        raise ValueError(f"{option} must be positive, got {text!r}")
    return int(value)


_UNIT = re.compile(r"\s*[0-9]*\.?[0-9]+\s*([kmgt]i?b?|b)\s*", re.IGNORECASE)


def is_size(text: str | float | int) -> bool:
    """Whether ``text`` is written as a byte size ("16MiB", "512KiB", "1.5GiB", "4096B"): a number with
    a unit, so "1e-1", "0.2" and "512" are not (they are a share and a count)."""
    return bool(_UNIT.fullmatch(str(text)))
