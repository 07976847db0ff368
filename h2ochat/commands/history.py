"""`h2ochat history`: the conversations `h2ochat run` kept, newest first; one of them in full."""

from __future__ import annotations

import json
import time
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from ..chat import history as store
from .. import options as o
from ..errors import strict_user_errors
from ..console import make_console


def when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds))


@strict_user_errors
def history(
    conversation: Annotated[Optional[str], typer.Argument(
        help="Show this conversation (an id, or its first characters) instead of the list.")] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=0, rich_help_panel=o.OUTPUT,
        help="Show the N most recent conversations (0 = all).")] = 20,
    as_json: o.Json = False,
):
    """List the kept conversations (date, model, turns, first line); resume one with
    `h2ochat run --continue` (the latest) or `--conversation ID`."""
    console = make_console()
    if conversation is not None:
        show(console, store.find(conversation), as_json)
        return
    entries = store.entries()
    shown = entries[:limit] if limit else entries
    if as_json:
        print(json.dumps([e.to_json() for e in shown], indent=2, ensure_ascii=False))
        return
    if not entries:
        console.print(f"no conversations kept yet (they go to {store.conversations_dir()})", markup=False)
        return
    if console.is_terminal:
        table = Table(title=f"Conversations in {store.conversations_dir()} (newest first)", title_justify="left")
        for column in ("id", "date", "model", "turns", "first line"):
            table.add_column(column, justify="right" if column == "turns" else "left", no_wrap=column != "first line")
        for e in shown:
            first = Text(f"unreadable: {e.error}", style="red") if e.error else Text(e.first_line[:80])
            table.add_row(e.id, when(e.updated), e.model, "" if e.error else str(e.turns), first)
        console.print(table)
    else:  # plain tab-separated columns for pipes and scripts
        for e in shown:
            first = f"unreadable: {e.error}" if e.error else e.first_line
            print(f"{e.id}\t{when(e.updated)}\t{e.model}\t{'' if e.error else e.turns}\t{first}")
    if len(shown) < len(entries):
        console.print(f"({len(entries) - len(shown)} older: --limit 0 shows all)", style="dim", markup=False)


def show(console, path, as_json: bool) -> None:
    data = store.read_conversation(path)
    if as_json:
        print(json.dumps(data, indent=2, ensure_ascii=False))
        return
    settings = data.get("settings") or {}
    console.print(f"{path.stem} · {data.get('model', '?')} · {when(float(data.get('updated') or path.stat().st_mtime))}",
                  style="bold", markup=False, highlight=False)
    if settings.get("system"):
        console.print(Text(f"system: {settings['system']}", style="dim"))
    for message in data["messages"]:
        if message["role"] == "user":
            console.print(Text(">>> " + message["content"], style="bold"))
        else:
            console.print(Text(message["content"] + (" [interrupted]" if message.get("interrupted") else "")))


def register(app: typer.Typer) -> None:
    app.command("history")(history)
