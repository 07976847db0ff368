"""`h2ochat eval`: perplexity of a text through every policy's cache at several budgets."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .. import evaluation as ev
from .. import options as o
from ..errors import user_errors
from ..generation import max_positions
from ..models import load


@user_errors
def eval_command(
    text: Annotated[Path, typer.Option("--text", "-f", rich_help_panel=o.OUTPUT,
        help="Plain-text file to continue token by token (only its first --tokens tokens are read).")],
    model: o.Model = o.DEFAULTS["model"],
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    tokens: Annotated[int, typer.Option("--tokens", min=2, rich_help_panel=o.CACHE,
        help="Tokens of the text to evaluate (no BOS added).")] = 2000,
    budget: Annotated[str, typer.Option("--budget", "-b", rich_help_panel=o.CACHE,
        help="Comma-separated budgets: slot counts (128) or fractions of --tokens (0.2).")] = ev.DEFAULT_BUDGETS,
    policies: Annotated[str, typer.Option("--policies", rich_help_panel=o.CACHE,
        help="Comma-separated policies to compare.")] = ",".join(ev.DEFAULT_POLICIES),
    heavy_ratio: o.HeavyRatio = 0.5,
    sinks: o.Sinks = 4,
    seed: Annotated[int, typer.Option("--seed", rich_help_panel=o.CACHE, help="Seed of the random policy.")] = 0,
    max_rows: Annotated[int, typer.Option("--max-rows", min=1, rich_help_panel=o.CACHE,
        help="(policy, budget) rows run as one batch; more run as further batches.")] = ev.MAX_ROWS,
    as_json: o.Json = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", rich_help_panel=o.OUTPUT,
        help="Write a PNG of perplexity against budget, one line per policy.")] = None,
):
    """Perplexity of a text continued token by token through each policy's cache, for each budget."""
    names = ev.parse_policies(policies)
    ev.parse_budgets(budget, tokens)  # bad syntax fails before the model loads
    if plot is not None and plot.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG file: give a name ending in .png, not {plot.name!r}")
    content = Path(text).read_text(encoding="utf-8")
    err = Console(stderr=True)
    with err.status(f"loading {model}", spinner="dots") if err.is_terminal else nullcontext():
        loaded = load(model, device, dtype)
    ids = ev.text_tokens(loaded.tokenizer, content, tokens)
    budgets = ev.parse_budgets(budget, len(ids))
    ev.check_inputs(len(ids), budgets, max_positions(loaded.model.config))
    rows = ev.build_rows(names, budgets, len(ids), heavy_ratio=heavy_ratio, sinks=sinks, seed=seed)

    speed = ev.Speed()
    batches = -(-len(rows) // max_rows)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as progress:
        task = progress.add_task(f"{len(rows)} rows x {len(ids)} tokens", total=batches * (len(ids) - 1), rate="")

        def advance(n: int) -> None:
            done = progress.tasks[0].completed + n
            elapsed = progress.tasks[0].elapsed or 0
            progress.update(task, advance=n, rate=f"{done / elapsed:.1f} tok/s" if elapsed else "")

        results = ev.evaluate_rows(loaded.model, ids, rows, max_rows=max_rows, on_step=advance, speed=speed)
    records = ev.records(results, budgets)
    report = {
        "model": loaded.name,
        "text": Path(text).name,
        "tokens": len(ids),
        "budgets": budgets,
        "heavy_ratio": heavy_ratio,
        "sinks": sinks,
        "seed": seed,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "results": records,
        "speed": {
            "rows": len(rows),
            "batches": batches,
            "forwards": speed.steps,
            "seconds": round(speed.seconds, 2),
            "forwards_per_s": round(speed.steps_per_s, 2),
            "predictions_per_s": round(speed.row_tokens_per_s, 2),
        },
    }
    if plot is not None:
        from ..plotting import perplexity_plot

        perplexity_plot(records, plot, title=f"{loaded.name} on {Path(text).name}, {len(ids)} tokens")
    if as_json:
        print(json.dumps(report, indent=2))
        return
    out = Console()
    out.print(_table(records, budgets, "perplexity", f"Perplexity over {len(ids)} tokens of {Path(text).name} "
                     f"({loaded.name}); ratio to full"))
    out.print(_table(records, budgets, "perplexity_after_fill",
                     "Perplexity of the predictions made after the first eviction; ratio to full over the same ones"))
    out.print(f"{len(rows)} rows in {batches} batch(es): {speed.steps} forwards in {speed.seconds:.0f} s "
              f"({speed.steps_per_s:.1f} forwards/s, {speed.row_tokens_per_s:.1f} predictions/s)"
              + (f"; plot written to {plot}" if plot else ""))


def _table(records: list[dict], budgets: list[int], field: str, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("policy")
    for slots in budgets:
        table.add_column(f"{slots} slots", justify="right")
    cells = {(r["policy"], r["budget_slots"]): r[field] for r in records}
    for policy in dict.fromkeys(r["policy"] for r in records):
        row = [policy]
        for slots in budgets:
            value, full = cells.get((policy, slots)), cells.get(("full", slots))
            if value is None:
                row.append("-")
            elif full:
                row.append(f"{value:.2f} ({value / full:.2f}x)")
            else:
                row.append(f"{value:.2f}")
        table.add_row(*row)
    return table


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
