"""The one list of --selector names the product accepts (no torch: read by --help and option checks).

The two-tier cache (``tiered.RecallConfig``) and the masked reference (``selectors.SELECTORS``, which
adds simulation-only digests on top) both build from this list, so a name one accepts the other runs.
"""

from __future__ import annotations

CODE_BITS = range(1, 9)  # intN / rotN: bits per code the packed digest stores (KeyCodes: 1-8)
CODED = ("int", "rot")  # plain codes, and codes after the fixed spreading rotation
PLAIN = ("exact", "quest")
AUTO = "auto"  # the default: exact where the cold store's keys can be scored in place (a CPU), else rot4

SELECTOR_HELP = ("auto (the default: exact on a CPU, where it scores the cold store's own keys, rot4 on a GPU), "
                 "exact (the best q.k of each page: the cold store's keys on a CPU, a copy on a GPU), quest (Quest's per-channel "
                 "min/max bound of each page), intN (the keys as N-bit codes, N 1-8) or rotN (the same after a "
                 "fixed rotation that spreads outlier channels: the better codes)")


def selector_names() -> list[str]:
    """Every name --selector accepts."""
    return [AUTO, *PLAIN, *(f"{kind}{bits}" for kind in CODED for bits in CODE_BITS)]


def resolved_selector(name: str, keys_in_place: bool) -> str:
    """The selector ``name`` stands for: ``auto`` is exact where the cold store's keys can be scored where
    they lie (``keys_in_place``: float keys in the step's memory), else rot4. On the CPU exact in place costs
    less than rot4 at 2K and 8K tokens, holds fewer host bytes, and gave every held-out pass-key trial the
    verdict rot4 gave (results_recall_selectors*.json, docs/results.md); on a GPU exact would keep every cold
    key on the device."""
    if name != AUTO:
        return name
    return "exact" if keys_in_place else "rot4"


def selector_kind(name: str) -> tuple[str, int | None]:
    """("exact" | "quest", None) or ("int" | "rot", bits); ValueError for a name not in the list
    (checked against the list itself: "int04" or "rot9" are refused as the simulation refuses them)."""
    if name not in selector_names():
        raise ValueError(f"--selector {name!r}: choose {SELECTOR_HELP}")
    if name in PLAIN or name == AUTO:
        return name, None
    return name[:3], int(name[3:])
