"""Options and helpers shared by the generating commands (run, generate, story) beyond options.py."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Annotated

import typer

from .. import options as o

RepeatLastN = Annotated[int, typer.Option("--repeat-last-n", min=-1, rich_help_panel=o.SAMPLING,
    help="The repetition penalty looks at the last N tokens only (0 or -1: the whole text), as llama.cpp "
         "and ollama do.")]


def compiling_note() -> str:
    """Said before a run with --compile, whose first token is followed by a silence while the step
    compiles; inductor's cache is moved to a folder that lasts (``loading.cache_dirs``) first."""
    from ..loading.cache_dirs import persistent_compile_cache

    folder = persistent_compile_cache()
    return ("compiling the decode step (--compile): the text pauses after its first token while it compiles, "
            f"minutes on a CPU the first time (docs/results.md: single stream), tens of seconds once the compile cache in "
            f"{folder} holds its graphs (the step is traced again in every run)")


def constant_of(module: str, name: str):
    """A module-level constant of ``h2ochat.<module>`` (a literal: a number, a string, a tuple), read
    from the module's source without importing it. The measuring modules import torch and
    transformers (seconds); their defaults shape options, and `--help` must not wait for them."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(f"h2ochat.{module}")
    tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"h2ochat.{module} has no constant {name}")


def loading(console, name: str):
    """Say what happens while the model loads, from the first second (imports and a first GGUF
    conversion take tens of seconds): on a terminal, a line naming the model and, unless a
    conversion will print its own progress bars, a spinner under it. Nothing in a pipe."""
    if not console.is_terminal:
        return nullcontext()
    from ..loading.gguf_conversion import first_load_note

    note = first_load_note(name)
    console.print(f"loading {name}…" + (f" ({note})" if note else ""), style="dim", markup=False, highlight=False)
    return nullcontext() if note else console.status(f"loading {name}…")
