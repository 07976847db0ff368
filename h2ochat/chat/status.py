"""The status line: the cache's figures read once per step (``summarize``, ``StatusLine``), fitted to
the terminal's width in a documented order (``STATUS_ORDER``), and the one-line summary of a turn.

Everything here reads the cache and returns text; nothing changes state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from rich.cells import cell_len

from ..kv import H2OCache
from ..engine.generation import Timing
from ..recall.report import TierSummary, TurnStart, summarize_tier
from .conversation import TurnResult
from .split import evicted_per_head
from .report import mean_evicted_share
from .prompt_progress import describe_reading, time_left
from .ui import format_duration
from .split import Memory, Split, amount, cache_split, describe_memory, describe_use, format_bytes, kv_memory, layer_splits


@dataclass
class CacheSummary:
    split: Split  # slots per part (sinks, heavy, recent, recall): capacity and in use, averaged (split.py)
    memory: Memory  # KV bytes reserved, in use, and what a full cache would hold
    evicted: float  # tokens evicted per (layer, KV head), averaged
    evicted_share: float | None  # attention an evicted token held when dropped (see report.evicted_share)
    seen: int
    layers: list = field(default_factory=list)  # the per-layer statistics it was made of
    layer_splits: list = field(default_factory=list)  # the per-layer splits it was made of
    tier: TierSummary | None = None  # the cold tier (--recall), None without one

    @property
    def held(self) -> float:
        """Tokens held per (layer, KV head), averaged, every device slot counted."""
        return self.split.held.total


def summarize(cache: H2OCache, since: TurnStart | None = None) -> CacheSummary:
    """The cache's state in figures (``since``: the turn's start, for the cold tier's turn figures).
    Reads the device several times per layer: compute it once per step (``StatusLine``), not once per
    render."""
    stats = cache.layer_stats()
    splits = layer_splits(cache)
    return CacheSummary(
        split=cache_split(cache, splits),
        memory=kv_memory(cache, splits),
        evicted=evicted_per_head(cache, sum(s.evicted for s in stats)),  # the count read above, not again
        evicted_share=mean_evicted_share(stats),
        seen=cache.longest_row_tokens(),
        layers=stats,
        layer_splits=splits,
        tier=summarize_tier(cache, since),
    )


def percent(share: float | None) -> str:
    if share is None:
        return "–"
    return f"{share:.1%}" if share >= 0.001 or share == 0 else f"{share:.2%}"


@dataclass(frozen=True)
class Figure:
    """One figure of the status line, in a long form and a short one for a narrow terminal."""
    long: str
    short: str


# When the terminal is narrow, the status line keeps its most telling figures: while a long prompt
# is read, how far it is and the time left (minutes, with nothing else moving); then how full the cache is, then what it has dropped, what it brought back, what it costs, how
# fast it goes and on how many threads. Before any figure goes, the slots lose their per-part
# breakdown, then the others take their short form from the least telling up (SHORTEN_ORDER).
STATUS_ORDER = ("reading", "held", "evicted", "recall", "memory", "rate", "threads")
SHORTEN_ORDER = ("held", "threads", "rate", "memory", "recall", "evicted", "reading")
STATUS_SEPARATOR = " │ "


def status_figures(s: CacheSummary, timing: Timing | None, live: bool,
                   reading: tuple[int, int, float] | None = None) -> dict[str, Figure]:
    """The status line's figures by name (see STATUS_ORDER), each in a long and a short form.
    ``reading``: (tokens read, of how many, seconds) while the prompt is read."""
    use = describe_use(s.split)
    figures = {"held": Figure(use, use.partition(": ")[0])}  # short: without the per-part breakdown
    evicted = f"{amount(s.evicted)}/{s.seen} tok evicted per layer and KV head"
    short = f"{amount(s.evicted)} evicted"
    if s.evicted_share is not None:  # the one figure of where the budget hurts (see /cache)
        evicted += f", held {percent(s.evicted_share)} attn"
        short += f" ({percent(s.evicted_share)} attn)"
    figures["evicted"] = Figure(evicted, short)
    if s.tier is not None:  # this turn's recalls: pages copied in per (layer, KV head), attention they drew
        # (the cold pages held beside the pages brought in: "0 pages" alone read as an empty cold store)
        figures["recall"] = Figure(f"recall: {amount(s.tier.pages_copied_turn)} of {amount(s.tier.cold_pages)} cold "
                                   f"pages in, {percent(s.tier.recalled_share_turn)} attn",
                                   f"recall {amount(s.tier.pages_copied_turn)}/{amount(s.tier.cold_pages)} pages")
    figures["memory"] = Figure(describe_memory(s.memory), f"KV {format_bytes(s.memory.in_use)}")
    if live:
        rate = timing.decode_tokens_per_s if timing is not None else 0.0
        if not rate and reading is not None:  # a long prompt takes minutes: say how far, and how long yet
            read, total, elapsed = reading
            left = time_left(read, total, elapsed)
            figures["reading"] = Figure(describe_reading(read, total, elapsed),
                                        f"prompt {read * 100 // max(total, 1)}%"
                                        + (f", {format_duration(left)} left" if left else ""))
        else:
            text = f"{rate:.1f} tok/s" if rate else "reading prompt…"
            figures["rate"] = Figure(text, text)
    from ..threads import chosen  # the CPU threads torch computes with (--threads or the rule's choice)

    if chosen() is not None:
        text = f"{chosen()} thread" + ("s" if chosen() != 1 else "")
        figures["threads"] = Figure(text, text)
    return figures


def fit_figures(figures: dict[str, Figure], width: int | None) -> str:
    """The figures joined in STATUS_ORDER within ``width`` columns (None: all of them, long). Narrower:
    the least telling go short first, then go; the most telling is cut with an ellipsis at the last."""
    names = [name for name in STATUS_ORDER if name in figures]
    if width is None:
        return STATUS_SEPARATOR.join(figures[name].long for name in names)
    for kept in range(len(names), 0, -1):
        chosen = names[:kept]
        shorten = [name for name in SHORTEN_ORDER if name in chosen]
        for shortened in range(len(shorten) + 1):
            short = set(shorten[:shortened])
            text = STATUS_SEPARATOR.join(figures[n].short if n in short else figures[n].long for n in chosen)
            if cell_len(text) <= width:
                return text
    first = figures[names[0]].short
    return first if len(first) <= width else first[: max(width - 1, 0)] + ("…" if width else "")


def status_line(cache: H2OCache, timing: Timing | None = None, live: bool = False,
                summary: CacheSummary | None = None, width: int | None = None,
                reading: tuple[int, int, float] | None = None) -> str:
    """`410/410 slots held: 205/205 heavy + 205/205 recent │ 1234/1644 tok evicted per layer and KV head, held
    0.8% attn │ KV 26.00 MiB in use of 26.00 MiB reserved (a full cache: 105.00 MiB) │ 14.8 tok/s`

    ``live``: a reply is being produced (``timing`` None means its prompt is still being read).
    ``summary``: the cache's figures when already at hand (else read now). ``width``: the columns it
    must fit (the terminal's); None: every figure in full."""
    return fit_figures(status_figures(summary or summarize(cache), timing, live, reading), width)


class StatusLine:
    """A status line whose figures are read from the device once per step, not once per render.

    prompt-toolkit redraws the bottom toolbar at every keystroke and the reply printer a few times a
    second; the cache only changes when a token is fed. The figures are kept under the cache and a
    ``progress`` key (what has been fed or generated so far, host counts), and read again only when
    one of these moves."""

    def __init__(self, cache: Callable[[], H2OCache], progress: Callable[[], object],
                 timing: Callable[[], Timing | None] = lambda: None,
                 reading: Callable[[], tuple[int, int, float] | None] = lambda: None):
        self.cache, self.progress, self.timing, self.reading = cache, progress, timing, reading
        self._seen: tuple | None = None  # (cache, progress) of the figures kept
        self._summary: CacheSummary | None = None
        self._turn_start: TurnStart | None = None  # the cold tier's counters when the turn began

    def begin_turn(self) -> None:
        """A turn starts: the cold tier's turn figures count from now (reads the device once)."""
        self._turn_start = TurnStart.of(self.cache())
        self._summary = None

    def cache_replaced(self) -> None:
        """A command outside a turn (/budget, /clear, /load, ...) put a new cache in: until the next
        turn, the cold tier's figures are the new cache's, not a turn's."""
        self._turn_start = None
        self._summary = None

    @classmethod
    def of_conversation(cls, conv) -> "StatusLine":
        """A chat's: tokens fed between turns, tokens generated in the turn under way."""
        return cls(lambda: conv.cache,
                   lambda: (len(conv.ids) + len(conv.pending), -1 if conv.current is None else conv.current.generated_tokens),
                   lambda: conv.current, conv.prompt_reading)

    def summary(self) -> CacheSummary:
        cache, progress = self.cache(), self.progress()
        if self._summary is None or self._seen is None or self._seen[0] is not cache or self._seen[1] != progress:
            self._seen, self._summary = (cache, progress), summarize(cache, self._turn_start)
        return self._summary

    def __call__(self, live: bool = False, width: int | None = None) -> str:
        return status_line(self.cache(), self.timing(), live=live, summary=self.summary(), width=width,
                           reading=self.reading() if live else None)


def turn_summary(result: TurnResult) -> str:
    t = result.timing
    if result.stopped_reading is not None:  # stopped before the reply began: no rates to give
        read, total, elapsed = result.stopped_reading
        rate = f" in {format_duration(elapsed)}" if elapsed >= 1 else ""
        return f"stopped while reading the prompt: {read:,} of {total:,} tokens read{rate}; nothing generated"
    return (f"{t.prompt_tokens} prompt tok at {t.prefill_tokens_per_s:.0f} tok/s · "
            f"{t.generated_tokens} generated at {t.decode_tokens_per_s:.1f} tok/s · "
            f"{amount(result.evicted)} tokens evicted this turn per layer and KV head (averaged)"
            + (" · interrupted" if result.interrupted else ""))
