"""A reply as it streams and the progress of a long prompt, on the terminal or plain.

On a terminal, replies stream with a live status line under them (``ReplyPrinter``) and a long
prompt shows a progress bar (``TokenProgress``); anywhere else (a pipe, a file, a test) the text is
written plain, with no cursor movement and no colour. Rich itself honours NO_COLOR and TERM=dumb.
The status line's figures are ``status``'s, the /cache and /hh views ``cache_view``'s.
"""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text


# -- streaming a reply ---------------------------------------------------------------------------
class ReplyPrinter:
    """Writes streamed text; on a terminal keeps a live status line under it.

    Finished lines are printed above the live area (Rich moves them out of the way); the line
    being written and the status line form the live area, refreshed a few times a second.
    """

    def __init__(self, console: Console, status, refresh_s: float = 0.25):
        self.console, self.status, self.refresh_s = console, status, refresh_s
        self.live: Live | None = None
        self.partial = ""
        self.last = 0.0

    def __enter__(self) -> "ReplyPrinter":
        if self.console.is_terminal and not self.console.is_dumb_terminal:
            self.live = Live(self._render(), console=self.console, auto_refresh=False, transient=True,
                             redirect_stdout=False, redirect_stderr=False)
            self.live.start(refresh=True)
        return self

    def _render(self):
        status = self.status()  # a status line, or any Rich renderable (a progress bar)
        return Group(Text(self.partial), Text(status, style="dim") if isinstance(status, str) else status)

    def write(self, piece: str) -> None:
        if self.live is None:
            self.console.file.write(piece)
            self.console.file.flush()
            return
        *done, self.partial = (self.partial + piece).split("\n")
        for line in done:
            self.console.print(Text(line))
        # a line longer than the terminal leaves the live area by whole rows (cut at a space), or
        # a paragraph with no line break would push the status line off the screen
        width = max(self.console.width, 20)
        while len(self.partial) > width:
            cut = self.partial.rfind(" ", 0, width + 1)
            cut = cut if cut > 0 else width
            self.console.print(Text(self.partial[:cut]))
            self.partial = self.partial[cut:].removeprefix(" ")
            done.append("")
        now = time.monotonic()
        if done or now - self.last >= self.refresh_s:
            self.last = now
            self.live.update(self._render(), refresh=True)

    def tick(self) -> None:
        """Refresh the status line without new text (e.g. while the prompt is read)."""
        if self.live is not None:
            self.live.update(self._render(), refresh=True)

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.stop()
            self.console.print(Text(self.partial))
        else:
            self.console.file.write("\n")
            self.console.file.flush()


# -- progress of a long run ----------------------------------------------------------------------
def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class _Rate(ProgressColumn):
    def render(self, task) -> Text:
        return Text(f"{task.speed:.1f} tok/s" if task.speed else "… tok/s", style="cyan")


class TokenProgress:
    """Tokens so far of the total, the rate and the time left, as a Rich progress bar: on a terminal
    only (a pipe or a file gets nothing, the caller prints a summary line at the end).

    ``embedded``: another live display (the ReplyPrinter under a streamed story) draws the bar
    through ``renderable``; otherwise the bar runs its own live display on ``console``.
    """

    def __init__(self, console: Console, embedded: bool = False):
        self.enabled = console.is_terminal and not console.is_dumb_terminal
        self.embedded = embedded
        self.progress = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("tok"), _Rate(), TimeRemainingColumn(compact=True), console=console,
                                 transient=True, auto_refresh=not embedded, refresh_per_second=4)
        self.task = None

    def phase(self, description: str, total: int) -> None:
        """Start counting a new phase (reading the text, writing the story) from zero."""
        if self.task is not None:
            self.progress.remove_task(self.task)
        self.task = self.progress.add_task(description, total=total)

    def update(self, completed: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, completed=completed)

    @property
    def renderable(self):
        return self.progress.get_renderable()

    def __enter__(self) -> "TokenProgress":
        if self.enabled and not self.embedded:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and not self.embedded:
            self.progress.stop()
