"""PNG charts for eval results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def perplexity_plot(records: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Perplexity against budget, one line per policy (``full`` as a flat reference line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG file: give a name ending in .png, not {path.name!r}")
    by_policy: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record["perplexity"] is not None:
            by_policy.setdefault(record["policy"], []).append((record["budget_slots"], record["perplexity"]))
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    for policy, points in by_policy.items():
        points.sort()
        budgets, values = zip(*points)
        style = {"linestyle": "--", "color": "black"} if policy == "full" else {"marker": "o"}
        axes.plot(budgets, values, label=policy, **style)
    axes.set_xscale("log", base=2)
    budgets_seen = sorted({b for points in by_policy.values() for b, _ in points})
    axes.set_xticks(budgets_seen, [str(b) for b in budgets_seen])
    axes.minorticks_off()
    axes.set_xlabel("KV budget (slots per layer and head)")
    axes.set_ylabel("perplexity")
    axes.set_title(title or "perplexity vs KV budget")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    plt.close(figure)
    return path
