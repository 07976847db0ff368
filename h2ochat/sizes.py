"""Reading amounts the user types: a share or a count (--budget, --recall) and a byte size (--kv-memory,
--budget 16MiB).

One reader for the whole product, so "1e-1" means the same to --budget as to --recall, and a size
means the same to bench as to serve. No torch here: these run before anything heavy is imported.
"""

from __future__ import annotations

import math
import re


def is_share(text: str | float | int) -> bool:
    """Whether ``text`` is written as a share: with a decimal point or an exponent, not a size."""
    raw = str(text).strip()
    return any(ch in raw for ch in ".eE") and not is_size(raw)


SHARE_OR_COUNT = "a share like 0.2 or a count like 512"


def parse_share_or_count(text: str | float | int, option: str, forms: str = SHARE_OR_COUNT) -> float | int:
    """A share written with a decimal point or an exponent ("0.2", "1.0", "1e-1") as a float, a
    whole number ("512", "1") as an int. So "1.0" is a share (all of it) and "1" is one.
    ValueError naming ``option`` and the ``forms`` it takes for anything else; the range is the
    caller's to check."""
    raw = str(text).strip()
    share = is_share(raw)
    try:
        value = float(raw) if share else int(raw)
    except ValueError:
        raise ValueError(f"{option} must be {forms}, got {raw!r}") from None
    if share and not math.isfinite(value):
        raise ValueError(f"{option} must be {forms}, got {raw!r}")
    return value


def parse_fraction(text: str | float | int, option: str, whole: int, forms: str = SHARE_OR_COUNT) -> int:
    """``parse_share_or_count`` turned into a count: a share in (0, 1] of ``whole`` (at least 1), or
    the count as written (at least 1)."""
    value = parse_share_or_count(text, option, forms)
    raw = str(text).strip()
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{option} as a share must be in (0, 1], got {raw}")
        return max(1, round(value * whole))
    if value < 1:
        raise ValueError(f"{option} as a count must be at least 1, got {raw}")
    return value


# a number (sign and exponent allowed, so a bad one can be named) and a unit; a bare number is bytes
_SIZE = re.compile(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)
# unit -> bytes: KiB... are powers of 1024, kB... (and a lone k, M, G, T) of 1000
UNITS = {"": 1, "b": 1, **{prefix + tail: base ** (power + 1)
                           for power, prefix in enumerate("kmgt")
                           for tail, base in (("", 1000), ("i", 1024), ("ib", 1024), ("b", 1000))}}
LARGEST_SIZE = 2**60  # 1 EiB: past any machine's memory, so a larger size is a typo
SIZE_EXAMPLE = "a size like 16MiB, 512KiB or 1.5GB"


def parse_size(text: str, option: str = "--kv-memory") -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes (KiB... are powers of 1024, kB... of 1000).
    ValueError naming ``option`` and what is wrong: not a size at all, an unknown unit, not
    positive, too large."""
    raw = str(text).strip()
    match = _SIZE.fullmatch(raw)
    if not match:
        raise ValueError(f"{option} must be {SIZE_EXAMPLE}, got {raw!r}")
    number, unit = match.groups()
    if unit.lower() not in UNITS:
        raise ValueError(f"{option} {raw}: unknown unit {unit!r}; write {SIZE_EXAMPLE} (B, KiB, MiB, GiB, TiB "
                         "or kB, MB, GB, TB)")
    value = float(number) * UNITS[unit.lower()]
    if value < 0:
        raise ValueError(f"{option} {raw}: a size cannot be negative ({SIZE_EXAMPLE})")
    if value < 1:
        raise ValueError(f"{option} {raw}: a size must be at least 1 byte ({SIZE_EXAMPLE})")
    if not math.isfinite(value) or value > LARGEST_SIZE:
        raise ValueError(f"{option} {raw}: too large a size (at most 1EiB; {SIZE_EXAMPLE})")
    return int(value)


_UNIT = re.compile(r"\s*[+-]?[0-9.]*[0-9]\.?(?:e[+-]?[0-9]+)?\s*[a-z]+\s*", re.IGNORECASE)


def is_size(text: str | float | int) -> bool:
    """Whether ``text`` is written as a byte size: a number with a unit ("16MiB", "512KiB", "1.5GiB",
    "4096B"; "16XB" and "-1MiB" too, for ``parse_size`` to say what is wrong with them), so "1e-1",
    "0.2" and "512" are not (they are a share and a count)."""
    return bool(_UNIT.fullmatch(str(text)))
