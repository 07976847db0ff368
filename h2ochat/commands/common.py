"""Options and helpers shared by the generating commands (run, generate, story) beyond options.py."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Annotated

import typer

from .. import options as o

RepeatLastN = Annotated[int, typer.Option("--repeat-last-n", min=-1, rich_help_panel=o.SAMPLING,
    help="The repetition penalty looks at the last N tokens only (0 or -1: the whole text), as llama.cpp "
         "and ollama do.")]


def loading(console, name: str):
    """A spinner while the model loads (a terminal only)."""
    return console.status(f"loading {name}…") if console.is_terminal else nullcontext()
