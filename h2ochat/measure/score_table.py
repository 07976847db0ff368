"""Scores of logged samples summed up per (cache row, task, length), with a binomial interval.

RULER's cell is the mean of the samples' scores (lm-eval's aggregate). The interval is Wilson's 95%
score interval over the samples, counting the mean as a share of them: exact for 0/1 scores (one
needle, one fact), a rough guide where a sample scores a part (several needles or words)."""

from __future__ import annotations

import math
from typing import Sequence

Z95 = 1.959963984540054


def wilson(share: float, count: int, z: float = Z95) -> tuple[float, float]:
    if count == 0:
        return (0.0, 1.0)
    denominator = 1 + z * z / count
    centre = (share + z * z / (2 * count)) / denominator
    half = z * math.sqrt(share * (1 - share) / count + z * z / (4 * count * count)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def summarize(records: Sequence[dict]) -> list[dict]:
    """One cell per (cache, task, length) in first-seen order, and per (cache, length) the average
    over tasks (task "average", RULER's headline: the mean of the tasks' means)."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault((record["cache"], record["task"], record["length"]), []).append(record)
    cells = []
    for (cache, task, length), group in groups.items():
        mean = sum(r["score"] for r in group) / len(group)
        low, high = wilson(mean, len(group))
        cells.append({"cache": cache, "task": task, "length": length, "samples": len(group),
                      "budget_slots": group[0].get("budget_slots"), "score": round(mean, 4),
                      "low": round(low, 4), "high": round(high, 4)})
    tasks = list(dict.fromkeys(cell["task"] for cell in cells))
    if len(tasks) > 1:
        by: dict[tuple, list[dict]] = {}
        for cell in cells:
            by.setdefault((cell["cache"], cell["length"]), []).append(cell)
        for (cache, length), group in by.items():
            if len(group) == len(tasks):  # an average of only some tasks would not compare
                cells.append({"cache": cache, "task": "average", "length": length,
                              "samples": sum(c["samples"] for c in group), "budget_slots": group[0]["budget_slots"],
                              "score": round(sum(c["score"] for c in group) / len(group), 4)})
    return cells


def table_cells(summary: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    """(column titles, rows): one row per cache, one column per (task, length): "score [low-high] n"."""
    columns = list(dict.fromkeys((c["task"], c["length"]) for c in summary))
    rows: dict[str, dict] = {}
    for cell in summary:
        text = f"{100 * cell['score']:.0f}"
        if "low" in cell:
            text += f" [{100 * cell['low']:.0f}-{100 * cell['high']:.0f}] n={cell['samples']}"
        rows.setdefault(cell["cache"], {})[(cell["task"], cell["length"])] = text
    titles = ["cache"] + [f"{task} {length}" for task, length in columns]
    return titles, [[cache] + [by.get(column, "-") for column in columns] for cache, by in rows.items()]


def score_plot(summary: Sequence[dict], path, title: str = "") -> None:
    """The average score against the budget's slots, one line per cache row (full: a flat line)."""
    from .plotting import _axes, _save

    path, figure, axes = _axes(path)
    task = "average" if any(c["task"] == "average" for c in summary) else summary[0]["task"]
    cells = [c for c in summary if c["task"] == task]
    for length in dict.fromkeys(c["length"] for c in cells):
        lines: dict[str, list] = {}
        for cell in cells:
            if cell["length"] == length:
                lines.setdefault(cell["cache"].split(" @ ")[0], []).append((cell["budget_slots"], cell["score"]))
        for name, points in lines.items():
            if name == "full":
                axes.axhline(points[0][1], linestyle="--", color="gray", label=f"full, {length}")
                continue
            points.sort()
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{name}, {length}")
    axes.set_xlabel("budget (device slots per layer)")
    axes.set_ylabel(f"{task} score")
    axes.set_title(title)
    _save(figure, axes, path)
