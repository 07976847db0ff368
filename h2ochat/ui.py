"""Rich rendering of the cache at work: the live status line, the /cache table, the /hh transcript.

Everything here reads the cache and returns text or Rich renderables; nothing changes state.
On a terminal, replies stream with a live status line under them; anywhere else (a pipe, a file,
a test) the text is written plain, with no cursor movement and no colour. Rich itself honours
NO_COLOR and TERM=dumb.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from .cache import H2OCache
from .chat import TurnResult, evicted_per_head
from .generation import Timing


def make_console(stderr: bool = False, file=None) -> Console:
    """A console that is plain (no colour, no live display) unless it writes to a terminal."""
    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    console = Console(file=stream, highlight=False, no_color=bool(os.environ.get("NO_COLOR")) or None)
    console.soft_wrap = not console.is_terminal  # a pipe gets whole lines, not lines cut at 80 columns
    return console


def format_bytes(count: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} B"


@dataclass
class CacheSummary:
    held: float  # tokens held per (layer, KV head), averaged
    capacity: int
    heavy: float
    recent: float
    evicted: float  # tokens evicted per (layer, KV head), averaged
    seen: int
    kv_bytes: int
    full_bytes: int


def summarize(cache: H2OCache) -> CacheSummary:
    stats = cache.layer_stats()
    count = max(len(stats), 1)
    return CacheSummary(
        held=sum(s.held for s in stats) / count,
        capacity=max((s.capacity for s in stats), default=0),
        heavy=sum(s.heavy for s in stats) / count,
        recent=sum(s.recent for s in stats) / count,
        evicted=evicted_per_head(cache),
        seen=cache.tokens_seen(),
        kv_bytes=cache.kv_bytes(),
        full_bytes=cache.full_kv_bytes(),
    )


def status_line(cache: H2OCache, timing: Timing | None = None, live: bool = False) -> str:
    """`KV 410/410 slots │ 205 heavy + 205 recent │ 1234/1644 evicted │ 26.1 MiB (full 105 MiB) │ 14.8 tok/s`

    ``live``: a reply is being produced (``timing`` None means its prompt is still being read)."""
    s = summarize(cache)
    parts = [
        f"KV {s.held:.0f}/{s.capacity} slots",
        f"{s.heavy:.0f} heavy + {s.recent:.0f} recent",
        f"{s.evicted:.0f}/{s.seen} tok evicted",
        f"{format_bytes(s.kv_bytes)} (full {format_bytes(s.full_bytes)})",
    ]
    if live:
        rate = timing.decode_tokens_per_s if timing is not None else 0.0
        parts.append(f"{rate:.1f} tok/s" if rate else "reading prompt…")
    return " │ ".join(parts)


def turn_summary(result: TurnResult) -> str:
    t = result.timing
    return (f"{t.prompt_tokens} prompt tok at {t.prefill_tokens_per_s:.0f} tok/s · "
            f"{t.generated_tokens} generated at {t.decode_tokens_per_s:.1f} tok/s · "
            f"{result.evicted:.0f} evicted this turn" + (" · interrupted" if result.interrupted else ""))


def cache_table(cache: H2OCache) -> Table:
    """One row per layer: slots used / capacity, heavy vs recent, evictions, score mass held."""
    budget = cache.budget
    table = Table(title=f"KV cache · policy {cache.policy.name} · {budget.slots} slots "
                        f"({budget.heavy} heavy + {budget.recent} recent" +
                        (f" + {budget.sinks} sinks" if budget.sinks else "") + ")",
                  title_justify="left", caption_justify="left")
    for name in ("layer", "used / capacity", "heavy", "recent", "evicted", "score mass held"):
        table.add_column(name, justify="right")
    for index, (layer, s) in enumerate(zip(cache.layers, cache.layer_stats())):
        rows = layer.evicted.numel() if layer.is_initialized else 1  # (sequence, KV head) pairs
        table.add_row(str(index), f"{s.held:.0f} / {s.capacity}", f"{s.heavy:.0f}", f"{s.recent:.0f}",
                      f"{s.evicted / rows:.0f}", f"{s.score_mass:.1f}")
    s = summarize(cache)
    table.caption = (f"{s.seen} tokens seen · KV {format_bytes(s.kv_bytes)} vs {format_bytes(s.full_bytes)} for a "
                     f"full cache · positions re-numbered {cache.compactions}× · counts are per KV head (averaged)")
    return table


# -- /hh -----------------------------------------------------------------------------------------
HEAVY, RECENT, EVICTED, PARTIAL = "heavy", "recent", "evicted", "partial"
STYLES = {HEAVY: "bold yellow", PARTIAL: "dim", RECENT: "", EVICTED: "dim strike"}


def token_classes(cache: H2OCache, token_count: int) -> list[str]:
    """For each token index fed so far (plus ``token_count - seen`` pending ones, counted recent):
    recent (protected window or sinks), heavy (kept on merit in most (layer, head) slots),
    partial (kept in some), evicted (kept nowhere)."""
    share = cache.cached_token_share().tolist()
    seen = len(share)
    budget = cache.budget
    classes = []
    for index in range(token_count):
        if index >= seen or index > seen - 1 - budget.recent or index < budget.sinks or not budget.evicts:
            classes.append(RECENT if index >= seen or share[index] > 0 else EVICTED)
        elif share[index] >= 0.5:
            classes.append(HEAVY)
        elif share[index] > 0:
            classes.append(PARTIAL)
        else:
            classes.append(EVICTED)
    return classes


def heavy_hitter_text(tokenizer, ids: list[int], cache: H2OCache) -> Text:
    """The conversation's tokens, styled by where they stand in the cache (runs of one class are
    decoded together so multi-byte characters survive)."""
    classes = token_classes(cache, len(ids))
    text = Text()
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or classes[end] != classes[start]:
            text.append(tokenizer.decode(ids[start:end], skip_special_tokens=False), style=STYLES[classes[start]])
            start = end
    return text


def heavy_hitter_legend(cache: H2OCache, ids_count: int) -> Text:
    classes = token_classes(cache, ids_count)
    legend = Text()
    for name, label in ((HEAVY, "heavy hitter (kept by most heads)"), (PARTIAL, "mostly evicted"),
                        (RECENT, "recent window / sinks"), (EVICTED, "evicted")):
        legend.append(f"{label}: {classes.count(name)}", style=STYLES[name])
        legend.append("   ")
    return legend


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
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
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
