"""The rich consoles every command prints through, in a module of its own: no torch, so commands
that load no model (`h2ochat history`) print without waiting for it."""

from __future__ import annotations

import os
import sys

from rich.console import Console


def make_console(stderr: bool = False, file=None) -> Console:
    """A console that is plain (no colour, no live display) unless it writes to a terminal.

    It reads no markup: what it prints comes from data (policy labels such as ``h2o [int8]``, model
    names, paths, the user's text), and Rich would take ``[int8]`` for a style and drop it. Style
    goes through ``style=`` or Text objects instead."""
    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    console = Console(file=stream, highlight=False, markup=False, no_color=bool(os.environ.get("NO_COLOR")) or None)
    console.soft_wrap = not console.is_terminal  # a pipe gets whole lines, not lines cut at 80 columns
    return console


def print_table(title: str, titles: list[str], cells: list[list[str]]) -> None:
    """A results table on standard output: the first column ("cache") left, the figures right."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for heading in titles:
        table.add_column(heading, justify="left" if heading == "cache" else "right")
    for row in cells:
        table.add_row(*row)
    make_console().print(table)
