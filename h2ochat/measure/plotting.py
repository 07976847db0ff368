"""PNG charts for eval results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def check_plot_path(path: str | Path) -> None:
    """Refuse before any work a --plot that is not a PNG name or cannot be written there: an evaluation
    that ran for an hour must not end on a bad path (ValueError)."""
    import tempfile

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG file: give a name ending in .png, not {path.name!r}")
    if path.is_dir():
        raise ValueError(f"--plot {path} is a directory: give a file name ending in .png")
    try:
        if path.exists():
            open(path, "ab").close()  # writable, and left as it is
        elif path.parent.is_dir():
            open(path, "xb").close()
            path.unlink()
        else:  # _save makes the missing folders: the nearest existing one must take a new folder
            existing = next(parent for parent in path.absolute().parents if parent.exists())
            tempfile.TemporaryDirectory(dir=existing).cleanup()
    except (OSError, StopIteration) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise ValueError(f"--plot {path} cannot be written ({reason}): give a writable path") from None


def _axes(path: str | Path):
    """A figure for a PNG at ``path`` (refused before any work if it is not one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG file: give a name ending in .png, not {path.name!r}")
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    return path, figure, axes


def _save(figure, axes, path: Path) -> Path:
    import matplotlib.pyplot as plt

    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    plt.close(figure)
    return path


def perplexity_plot(records: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Perplexity against budget, one line per policy (``full`` as a flat reference line)."""
    path, figure, axes = _axes(path)
    by_policy: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record["perplexity"] is not None:
            by_policy.setdefault(record["policy"], []).append((record["budget_slots"], record["perplexity"]))
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
    return _save(figure, axes, path)


def passkey_plot(summary: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """The share of pass-key trials recalled per (length, depth), one bar per cache row
    (``passkey.summarize``'s records)."""
    path, figure, axes = _axes(path)
    cells = list(dict.fromkeys((s["length"], s["depth"]) for s in summary))
    rows = list(dict.fromkeys(s["row"] for s in summary))
    share = {(s["row"], s["length"], s["depth"]): s["recalled"] / s["trials"] for s in summary if s["trials"]}
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        xs = [c + (i - (len(rows) - 1) / 2) * width for c in range(len(cells))]
        axes.bar(xs, [share.get((row, *cell), 0.0) for cell in cells], width, label=row)
    axes.set_xticks(range(len(cells)), [f"{length} tok\ndepth {depth:g}" for length, depth in cells])
    axes.set_ylim(0, 1.05)
    axes.set_ylabel("share of trials recalled")
    axes.set_title(title or "pass key recalled")
    axes.grid(True, axis="y", alpha=0.3)
    return _save(figure, axes, path)
