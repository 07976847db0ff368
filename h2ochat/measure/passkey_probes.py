"""The harder pass-key probes: contexts sized against the device slots, and each miss attributed.

``--lengths 7x,16x`` asks for filler 7 and 16 times each budget's device slots (896 and 2048 tokens
at 128 slots), beside plain token counts (``880``); a row of B slots runs the plain lengths and its
own multiples of B, the full cache runs every length (it is the reference of each).

A miss of a cache row is put down to one of (``CAUSES``), from the rows beside it on the same trial:
the model (the full cache misses that fact too), the selector (a recall row whose twin with the
``exact`` selector, every cold token scored exactly, recalls it), or the cache (the full cache
recalls it and the exact twin misses it too, or the row has no selector: eviction and the hot /
recall split lost it). A recall row with no exact twin beside it cannot tell the last two apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

CAUSES = ("model", "selector", "cache", "cache or selector")


@dataclass(frozen=True)
class LengthSpec:
    """One entry of --lengths: filler tokens (``tokens``), or a multiple of the device slots (``ratio``)."""

    text: str
    tokens: int | None = None
    ratio: float | None = None

    def resolve(self, slots: int) -> int:
        return self.tokens if self.ratio is None else int(round(self.ratio * slots))


def parse_lengths(text: str) -> list[LengthSpec]:
    """Comma-separated token counts (880) or multiples of the device slots (16x)."""
    specs = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        relative = part.lower().endswith("x")
        try:
            value = float(part[:-1]) if relative else int(part)
        except ValueError:
            raise ValueError(f"--lengths takes comma-separated token counts (880) or multiples of the device "
                             f"slots (16x), got {part!r}") from None
        if not (value > 0 and math.isfinite(value)):  # also refuses nan and inf
            raise ValueError(f"--lengths entries must be above 0, got {part!r}")
        specs.append(LengthSpec(part, ratio=value) if relative else LengthSpec(part, tokens=value))
    if not specs:
        raise ValueError("--lengths needs at least one value")
    return specs


class LengthPlan:
    """Which filler lengths each budget runs (``for_slots``), every one of them (``lengths``), and
    how a table names each."""

    def __init__(self, specs: Sequence[LengthSpec], budgets: Sequence[int]):
        self.specs, self.budgets = list(specs), list(budgets)
        self._origin: dict[int, str] = {}  # length -> how it was asked for, for the table
        for slots in self.budgets:
            for spec in self.specs:
                length = spec.resolve(slots)
                if length < 1:
                    raise ValueError(f"--lengths {spec.text} at {slots} slots is {length} tokens: too short")
                self._origin.setdefault(length, spec.text if spec.ratio is None else f"{spec.text} {slots} slots")

    @property
    def relative(self) -> bool:
        return any(spec.ratio is not None for spec in self.specs)

    def lengths(self) -> list[int]:
        """Every length some row runs, in the order asked."""
        return list(self._origin)

    def for_slots(self, slots: int | None) -> set[int]:
        """The lengths a row of ``slots`` device slots runs (None: a cache that grows runs them all)."""
        if slots is None:
            return set(self._origin)
        return {spec.resolve(slots) for spec in self.specs}

    def wanted(self, row, trial) -> bool:
        return trial.length in self.for_slots(getattr(row, "device_slots", None))

    def length_title(self, length: int) -> str:
        """"880 tok", or "2048 tok (16x 128 slots)" for a length asked as a multiple."""
        origin = self._origin.get(length, str(length))
        return f"{length} tok" + (f" ({origin})" if origin != str(length) else "")

    def title(self, length: int, depth: float) -> str:
        return f"{self.length_title(length)}, depth {depth:g}"

    def describe(self) -> dict:
        return {"asked": [spec.text for spec in self.specs],
                "by_device_slots": {str(slots): sorted(self.for_slots(slots)) for slots in self.budgets}}


def budgets_for(budget: str, specs: Sequence[LengthSpec], parse_budgets) -> list[int]:
    """--budget against the lengths: a fraction of the text needs one length to be a fraction of,
    and a length given as a multiple of the slots has none."""
    tokens = [spec.tokens for spec in specs if spec.ratio is None]
    if any(spec.ratio is not None for spec in specs):
        # a fraction gives different slots for different texts; slot counts do not
        if parse_budgets(budget, 1000) != parse_budgets(budget, 2000):
            raise ValueError(f"--lengths {','.join(s.text for s in specs)} (multiples of the device slots) needs "
                             f"--budget in slots (128), not a fraction of the text ({budget})")
        return parse_budgets(budget, 1 << 30)
    return parse_budgets(budget, min(tokens))


# -- misses attributed ----------------------------------------------------------------------------

def _trial_key(record: dict) -> tuple:
    return record["length"], record["depth"], record["window"], record["key"]


def _each(record: dict) -> list[bool]:
    return record.get("recalled_each", [record["recalled"]])


def exact_twins(rows: Sequence) -> dict[str, str]:
    """Label of each recall row with a non-exact selector -> label of the row beside it that differs
    only in using the exact selector."""
    with_settings = [row for row in rows if getattr(row, "settings", None) is not None]
    twins = {}
    for row in with_settings:
        if not row.settings.recall or row.settings.selector == "exact":
            continue
        exact = replace(row.settings, selector="exact")
        twin = next((other.label for other in with_settings if other.settings == exact), None)
        if twin is not None:
            twins[row.label] = twin
    return twins


def attribute(results: Sequence[dict], rows: Sequence) -> list[dict]:
    """The records with ``miss_causes`` (one per fact: None where recalled, else one of ``CAUSES``)
    on every row but the full cache's; unchanged where no full-cache row ran (nothing to attribute)."""
    full = {row.label for row in rows if getattr(row, "device_slots", 0) is None}
    reference = {_trial_key(r): _each(r) for r in results if r["row"] in full}
    if not reference:
        return list(results)
    twins = exact_twins(rows)
    selectors = {row.label: row.settings.selector for row in rows
                 if getattr(row, "settings", None) is not None and row.settings.recall}
    outcomes = {(r["row"], _trial_key(r)): _each(r) for r in results}
    out = []
    for record in results:
        key = _trial_key(record)
        if record["row"] in full or key not in reference:
            out.append(record)
            continue
        twin = outcomes.get((twins.get(record["row"]), key))  # the exact twin's answers to this trial
        causes = []
        for fact, got in enumerate(_each(record)):
            if got:
                causes.append(None)
            elif not reference[key][fact]:
                causes.append("model")
            elif twin is not None:
                causes.append("selector" if twin[fact] else "cache")
            else:  # no selector (plain eviction), or the exact selector itself: the cache lost it
                causes.append("cache" if selectors.get(record["row"], "exact") == "exact" else "cache or selector")
        out.append({**record, "miss_causes": causes})
    return out


def miss_counts(results: Sequence[dict]) -> dict[str, dict[str, int]]:
    """Per row, how many missed facts each cause took (rows with nothing to attribute left out)."""
    counts: dict[str, dict[str, int]] = {}
    for record in results:
        if "miss_causes" not in record:
            continue
        row = counts.setdefault(record["row"], {})
        for cause in record["miss_causes"]:
            if cause is not None:
                row[cause] = row.get(cause, 0) + 1
    return counts


def with_misses(titles: list[str], cells: list[list[str]], counts: dict[str, dict[str, int]]
                ) -> tuple[list[str], list[list[str]]]:
    """The table with a last column: each row's misses by cause ("model 2, selector 1")."""
    if not counts:
        return titles, cells
    rows = []
    for cell in cells:
        by = counts.get(cell[0])
        text = "-" if by is None else (", ".join(f"{c} {by[c]}" for c in CAUSES if c in by) or "none")
        rows.append(cell + [text])
    return titles + ["misses: put down to"], rows
