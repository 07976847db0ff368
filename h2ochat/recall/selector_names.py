"""The one list of --selector names the product accepts (no torch: read by --help and option checks).

The two-tier cache (``tiered.RecallConfig``) and the masked reference (``selectors.SELECTORS``, which
adds simulation-only digests on top) both build from this list, so a name one accepts the other runs.
"""

from __future__ import annotations

CODE_BITS = range(1, 9)  # intN / rotN: bits per code the packed digest stores (KeyCodes: 1-8)
CODED = ("int", "rot")  # plain codes, and codes after the fixed spreading rotation
PLAIN = ("exact", "quest")

SELECTOR_HELP = ("exact (the best q.k of each page: the keys kept on the device), quest (Quest's per-channel "
                 "min/max bound of each page), intN (the keys as N-bit codes, N 1-8) or rotN (the same after a "
                 "fixed rotation that spreads outlier channels: the better codes)")


def selector_names() -> list[str]:
    """Every name --selector accepts."""
    return [*PLAIN, *(f"{kind}{bits}" for kind in CODED for bits in CODE_BITS)]


def selector_kind(name: str) -> tuple[str, int | None]:
    """("exact" | "quest", None) or ("int" | "rot", bits); ValueError for a name not in the list
    (checked against the list itself: "int04" or "rot9" are refused as the simulation refuses them)."""
    if name not in selector_names():
        raise ValueError(f"--selector {name!r}: choose {SELECTOR_HELP}")
    if name in PLAIN:
        return name, None
    return name[:3], int(name[3:])
