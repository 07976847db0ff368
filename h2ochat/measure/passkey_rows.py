"""The pass-key rows a command asks for and the table of their results: ``--lengths`` and ``--depths``
read (``parse_numbers``), every policy at every budget, then with each recall setting and each slot
format (``build_rows``: ``passkey.CacheRow`` and ``MaskedRow``), and one table row per cache row,
one column per (length, depth) (``table_rows``)."""

from __future__ import annotations

from typing import Callable, Sequence

from ..config import CacheSettings
from .passkey import CacheRow, MaskedRow


def parse_numbers(text: str, kind, name: str) -> list:
    try:
        values = [kind(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{name} takes comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{name} needs at least one value")
    return values


def build_rows(policies: Sequence[str], budgets: Sequence[int], recalls: Sequence[CacheSettings] = (), *,
               recall_chunk: int = 1, masked: bool = False, settings: dict | None = None,
               kv_dtypes: Sequence[str] = ("auto",)) -> list:
    """Rows: each policy at each budget through the real cache (``full`` once), then each evicting
    policy with each recall setting (``CacheSettings`` with recall, page, selector, ... set: see
    ``evaluation.recall_settings``) through the two-tier cache, measuring its selector's share of the
    exact top pages (``masked``: through the masked reference simulation as well). Recall rows feed
    the question token by token (``recall_chunk``). ``kv_dtypes`` (--kv-dtype auto,int8): the rows
    again for each slot format after the first, named with it (``[int8]``); the full cache once."""
    rows: list = []
    for index, kv_dtype in enumerate(kv_dtypes):
        extra = {**(settings or {}), "kv_dtype": kv_dtype}
        tag = "" if index == 0 and kv_dtype == "auto" else f" [{kv_dtype}]"
        rows += _rows_of_one_format(policies, budgets, recalls, recall_chunk, masked, extra, tag,
                                    with_full=index == 0)
    return rows


def _rows_of_one_format(policies, budgets, recalls, recall_chunk, masked, extra, tag, with_full) -> list:
    from dataclasses import replace

    from ..policies import get_policy

    rows: list = []
    for slots in budgets:
        for spec in policies:
            policy = get_policy(spec)
            if policy.grows:
                if with_full and not any(isinstance(r, CacheRow) and r.label == "full" for r in rows):
                    rows.append(CacheRow("full", CacheSettings(policy=spec, budget=str(slots), **extra)))
                continue
            rows.append(CacheRow(f"{policy.label} {slots}{tag}", CacheSettings(policy=spec, budget=str(slots), **extra)))
            for recall_settings in recalls:
                settings_r = replace(recall_settings, policy=spec, budget=str(slots), **extra)
                config = settings_r.recall_config(slots)  # bad recall settings fail before the model loads
                settings_r.validate()
                name = (f"{policy.label} {slots} = {slots - config.slots} hot + {config.slots} recall "
                        f"({config.selector}, pages of {config.page}{config.rest_label}){tag}")
                rows.append(CacheRow(name, settings_r, question_chunk=recall_chunk, measure=True))
                if masked and not tag:  # (the masked reference holds float keys)
                    rows.append(MaskedRow(f"{name}; masked reference", spec, slots - config.slots, config.slots,
                                          config.page, config.selector, grouping="eviction",
                                          question_chunk=recall_chunk))
    return rows


def table_rows(summary: Sequence[dict], column: Callable[[int, float], str] | None = None
               ) -> tuple[list[str], list[list[str]]]:
    """(column titles, rows of cells): one row per cache row, one column per (length, depth), titled
    by ``column(length, depth)``."""
    columns = list(dict.fromkeys((s["length"], s["depth"]) for s in summary))
    cells: dict[str, dict] = {}
    for s in summary:
        cell = f"{s['recalled']}/{s['trials']}"
        if "recalled_per_fact" in s:  # all facts, then each fact alone
            cell += " (" + ", ".join(f"{('1st', '2nd')[i]} {n}" for i, n in enumerate(s["recalled_per_fact"])) + ")"
        cells.setdefault(s["row"], {})[(s["length"], s["depth"])] = cell
    shares: dict[str, list[float]] = {}
    for s in summary:
        if "exact_top_pages_found" in s:
            shares.setdefault(s["row"], []).append(s["exact_top_pages_found"])
    column = column or (lambda length, depth: f"{length} tok, depth {depth:g}")
    titles = ["cache"] + [column(length, depth) for length, depth in columns]
    if shares:
        titles.append("exact top pages found")
    rows = []
    for row, by in cells.items():
        rows.append([row] + [by.get(c, "-") for c in columns])
        if shares:
            found = shares.get(row)
            rows[-1].append(f"{100 * sum(found) / len(found):.1f}%" if found else "-")
    return titles, rows
