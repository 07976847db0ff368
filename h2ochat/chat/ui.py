"""Rich rendering of the cache at work: the live status line, the /cache table, the /hh transcript.

Everything here reads the cache and returns text or Rich renderables; nothing changes state.
On a terminal, replies stream with a live status line under them; anywhere else (a pipe, a file,
a test) the text is written plain, with no cursor movement and no colour. Rich itself honours
NO_COLOR and TERM=dumb.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from rich.console import Console, Group
from rich.cells import cell_len
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from ..kv import H2OCache
from ..policies import protected
from .conversation import TurnResult, evicted_per_head
from ..console import make_console  # noqa: F401  (imported from here too)
from ..engine.generation import Timing
from ..recall.report import TierSummary, TurnStart, has_cold_tier, recall_slot_counts, summarize_tier
from .report import mean_evicted_share, part_shares
from .split import (Memory, Split, amount, cache_split, describe_memory, describe_slots, describe_use, format_bytes,
                    kv_memory, layer_splits)


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


# When the terminal is narrow, the status line keeps its most telling figures: what a newcomer reads
# first is how full the cache is, then what it has dropped, what it brought back, what it costs, how
# fast it goes and on how many threads. Before any figure goes, the slots lose their per-part
# breakdown, then the others take their short form from the least telling up (SHORTEN_ORDER).
STATUS_ORDER = ("held", "evicted", "recall", "memory", "rate", "threads")
SHORTEN_ORDER = ("held", "threads", "rate", "memory", "recall", "evicted")
STATUS_SEPARATOR = " │ "


def status_figures(s: CacheSummary, timing: Timing | None, live: bool) -> dict[str, Figure]:
    """The status line's figures by name (see STATUS_ORDER), each in a long and a short form."""
    use = describe_use(s.split)
    figures = {"held": Figure(use, use.partition(": ")[0])}  # short: without the per-part breakdown
    evicted = f"{amount(s.evicted)}/{s.seen} tok evicted per layer and KV head"
    short = f"{amount(s.evicted)} evicted"
    if s.evicted_share is not None:  # the one figure of where the budget hurts (see /cache)
        evicted += f", held {percent(s.evicted_share)} attn"
        short += f" ({percent(s.evicted_share)} attn)"
    figures["evicted"] = Figure(evicted, short)
    if s.tier is not None:  # this turn's recalls: pages copied in per (layer, KV head), attention they drew
        figures["recall"] = Figure(f"recall: {amount(s.tier.pages_copied_turn)} pages in, "
                                   f"{percent(s.tier.recalled_share_turn)} attn",
                                   f"recall {amount(s.tier.pages_copied_turn)} pages")
    figures["memory"] = Figure(describe_memory(s.memory), f"KV {format_bytes(s.memory.in_use)}")
    if live:
        rate = timing.decode_tokens_per_s if timing is not None else 0.0
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
                summary: CacheSummary | None = None, width: int | None = None) -> str:
    """`410/410 slots held: 205/205 heavy + 205/205 recent │ 1234/1644 tok evicted per layer and KV head, held
    0.8% attn │ KV 26.00 MiB in use of 26.00 MiB reserved (a full cache: 105.00 MiB) │ 14.8 tok/s`

    ``live``: a reply is being produced (``timing`` None means its prompt is still being read).
    ``summary``: the cache's figures when already at hand (else read now). ``width``: the columns it
    must fit (the terminal's); None: every figure in full."""
    return fit_figures(status_figures(summary or summarize(cache), timing, live), width)


class StatusLine:
    """A status line whose figures are read from the device once per step, not once per render.

    prompt-toolkit redraws the bottom toolbar at every keystroke and the reply printer a few times a
    second; the cache only changes when a token is fed. The figures are kept under the cache and a
    ``progress`` key (what has been fed or generated so far, host counts), and read again only when
    one of these moves."""

    def __init__(self, cache: Callable[[], H2OCache], progress: Callable[[], object],
                 timing: Callable[[], Timing | None] = lambda: None):
        self.cache, self.progress, self.timing = cache, progress, timing
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
                   lambda: conv.current)

    def summary(self) -> CacheSummary:
        cache, progress = self.cache(), self.progress()
        if self._summary is None or self._seen is None or self._seen[0] is not cache or self._seen[1] != progress:
            self._seen, self._summary = (cache, progress), summarize(cache, self._turn_start)
        return self._summary

    def __call__(self, live: bool = False, width: int | None = None) -> str:
        return status_line(self.cache(), self.timing(), live=live, summary=self.summary(), width=width)


def turn_summary(result: TurnResult) -> str:
    t = result.timing
    return (f"{t.prompt_tokens} prompt tok at {t.prefill_tokens_per_s:.0f} tok/s · "
            f"{t.generated_tokens} generated at {t.decode_tokens_per_s:.1f} tok/s · "
            f"{amount(result.evicted)} tokens evicted this turn per layer and KV head (averaged)"
            + (" · interrupted" if result.interrupted else ""))


# -- /cache ----------------------------------------------------------------------------------------
BLOCKS = "▁▂▃▄▅▆▇█"
LAYER_TABLE_MAX = 24  # more layers than this: the strips only (`/cache layers` shows the table anyway)


def share_style(share: float | None, held: float) -> str:
    """Colour of an evicted-attention share, against what an average held slot gets (1 / held): below
    it the evicted tokens were the least attended (green), far above it the layer wants more slots."""
    if share is None or held <= 0:
        return "dim"
    ratio = share * held
    return "green" if ratio < 1 else "yellow" if ratio < 3 else "red"


def strip(values: list[float | None], styles: list[str], width: int, top: float) -> Text:
    """One block character per layer (or per group of layers when they do not fit), its height the
    value against ``top`` (a fixed scale, so equal layers do not all look full); no value: a dim dot."""
    groups = max(1, -(-len(values) // max(width, 1)))  # layers per character
    text = Text()
    top = top or 1.0
    for start in range(0, len(values), groups):
        chunk = [(v, st) for v, st in zip(values[start : start + groups], styles[start : start + groups]) if v is not None]
        if not chunk:
            text.append("·", style="dim")
            continue
        value, style = max(chunk, key=lambda item: item[0])  # a group shows its worst layer
        text.append(BLOCKS[max(0, min(len(BLOCKS) - 1, int(value / top * (len(BLOCKS) - 1) + 0.5)))], style=style)
    return text


def bar(share: float, width: int = 12) -> Text:
    filled = int(round(share * width))
    return Text("█" * filled + "░" * (width - filled), style="green" if share >= 0.5 else "yellow" if share > 0 else "red")


def cache_view(cache: H2OCache, parts: list[tuple[str, int, int]] | None = None, all_layers: bool = False,
               width: int = 80, summary: CacheSummary | None = None):
    """The /cache view: where the budget hurts, per layer (as strips that fit any depth, and as a table
    for a few layers) and per part of the conversation. ``summary``: the figures when at hand."""
    s = summary or summarize(cache)
    stats = s.layers
    shares = [st.evicted_share if st.evicted else None for st in stats]
    styles = [share_style(share, st.held) for share, st in zip(shares, stats)]
    # the recall slots are device slots of the budget too, as --budget counts them
    title = Text(f"KV cache · policy {cache.policy.name} · {describe_slots(s.split, ' per layer and KV head')} · "
                 f"{s.seen} tokens seen, {amount(s.evicted)} evicted per layer and KV head · "
                 f"{describe_memory(s.memory)}", style="bold")
    lines = [title, Text(f"  now {describe_use(s.split)} (per layer and KV head, averaged)")]
    label = f"L0–L{len(stats) - 1}"
    span = max(16, width - len(label) - 4)  # one strip fits the terminal however deep the model
    if s.evicted_share is None:
        lines.append(Text("nothing evicted yet: every token read is still held", style="dim"))
    else:
        worst = max(range(len(stats)), key=lambda i: shares[i] if shares[i] is not None else -1.0)
        lines.append(Text("attention the evicted tokens held when dropped (near 0 = harmless; high = the layer "
                          "wants more slots; a full block = 4x what an average slot holds)", style="dim"))
        lines.append(Text.assemble(f"  {label} ", strip(shares, styles, span, 4 / s.held if s.held else 1.0)))
        lines.append(Text(f"  mean {percent(s.evicted_share)} · worst layer {worst} {percent(shares[worst])} · "
                          f"an average slot holds {percent(1 / s.held if s.held else None)}"))
    medians = [st.heavy_age_median for st in stats]
    if any(m is not None for m in medians):
        oldest = max(st.heavy_age_oldest for st in stats if st.heavy_age_oldest is not None)
        known = sorted(m for m in medians if m is not None)
        lines.append(Text("age of the heavy hitters kept (tokens since they were read, median per layer; a full "
                          "block = as old as the conversation)", style="dim"))
        lines.append(Text.assemble(f"  {label} ", strip(medians, ["cyan"] * len(medians), span, s.seen)))
        lines.append(Text(f"  median {known[(len(known) - 1) // 2]:.0f} · oldest {oldest}"))
    if parts:
        lines.append(Text("still held, per part of the conversation (share of its tokens' slots, all layers and "
                          "heads)", style="dim"))
        table = Table(box=None, padding=(0, 1))
        for name, justify in (("part", "left"), ("tokens", "right"), ("held", "left"), ("", "right")):
            table.add_column(name, justify=justify, no_wrap=name != "part")
        for record in part_shares(cache, parts):
            if record["held_share"] is None:
                continue
            name = record["name"] if len(record["name"]) <= 40 else record["name"][:39] + "…"
            table.add_row(name, str(record["tokens"]), bar(record["held_share"]), f"{record['held_share']:.0%}")
        lines.append(table)
    if s.tier is not None:
        lines.extend(cold_tier_lines(s.tier, s.split))
    if all_layers or len(stats) <= LAYER_TABLE_MAX:
        table = Table(title_justify="left", box=None, padding=(0, 1))
        shown = [name for name, value in s.split.slots.items() if value or name in ("heavy", "recent")]
        for name in ("layer", "held / slots", " + ".join(shown) + " held", "evicted held", "heavy age median", "oldest"):
            table.add_column(name, justify="right")
        for index, (st, split, share, style) in enumerate(zip(stats, s.layer_splits, shares, styles)):
            held = split.held
            table.add_row(str(index), f"{amount(held.total)} / {amount(split.slots.total)}",
                          " + ".join(amount(getattr(held, name)) for name in shown),
                          Text(percent(share), style=style),
                          "–" if st.heavy_age_median is None else f"{st.heavy_age_median:.0f}",
                          "–" if st.heavy_age_oldest is None else str(st.heavy_age_oldest))
        lines.append(table)
    lines.append(Text(f"counts are per KV head (averaged) · positions re-numbered {cache.compactions}×"
                      + ("" if all_layers or len(stats) <= LAYER_TABLE_MAX else " · /cache layers: the per-layer table"),
                      style="dim"))
    return Group(*lines)


def cold_tier_lines(tier: TierSummary, split: Split) -> list[Text]:
    """/cache's cold-tier block (--recall): what the cold store holds, what came back (the recall
    slots in use: ``split``'s), what it drew."""
    scope = "this turn" if tier.this_turn else "since this cache was built"
    limit = ("no --cold-limit" if tier.cold_limit is None else
             f"--cold-limit {tier.cold_limit}: {amount(tier.dropped_tokens)} tokens dropped")
    copied = (f"{amount(tier.pages_copied_turn)} pages copied in this turn, {amount(tier.pages_copied)} in all"
              if tier.this_turn else f"{amount(tier.pages_copied)} pages copied in since this cache was built")
    turn_share = (f"{percent(tier.recalled_share_turn)} of the attention {scope} went to recalled tokens"
                  if tier.recalled_share_turn is not None else f"nothing attended {scope}")
    return [
        Text(f"cold tier: evicted tokens in host memory, the best pages brought back into {tier.recall_slots} "
             f"recall slots per layer and KV head (pages of {tier.page}, selector {tier.selector})", style="dim"),
        Text(f"  cold store  {amount(tier.cold_pages)} pages ({amount(tier.cold_tokens)} tokens) per layer and KV "
             f"head · {format_bytes(tier.host_bytes)} on the host · {limit}"),
        Text(f"  staging     {amount(tier.staged_tokens)} tokens waiting for the next page to the cold store"),
        Text(f"  device      {format_bytes(tier.device_bytes)} beyond the recall slots, of which "
             f"{format_bytes(tier.digest_bytes)} to score pages "
             + ("(one stage: grows with the text)" if tier.summary_cap is None else
                f"({tier.summary_cap} summaries cap, {tier.pages_per_summary} page{'' if tier.pages_per_summary == 1 else 's'} each"
                + (": the cap coarsened them)" if tier.pages_per_summary > 1 else ")"))),
        Text(f"  recalled    {copied} · {amount(split.held.recall)} tokens in recall slots now"),
        Text(f"  attention   {turn_share}" + (f" ({percent(tier.recalled_share)} since this cache was built)"
                                               if tier.this_turn else "")),
    ]


# -- /hh -----------------------------------------------------------------------------------------
HEAVY, RECENT, EVICTED, PARTIAL, RECALLED = "heavy", "recent", "evicted", "partial", "recalled"
STYLES = {HEAVY: "bold yellow", PARTIAL: "dim", RECENT: "", EVICTED: "dim strike", RECALLED: "bold cyan underline"}


def token_classes(cache: H2OCache, token_count: int) -> list[str]:
    """For each token index fed so far (plus ``token_count - seen`` pending ones, counted recent):
    recent (protected window or sinks), recalled (--recall: in a recall slot of some (layer, head)
    now, brought back from the cold tier), heavy (kept on merit in most (layer, head) slots),
    partial (kept in some), evicted (kept nowhere)."""
    share = cache.cached_token_share().tolist()
    recalled = set(recall_slot_counts(cache).nonzero().flatten().tolist())
    seen = len(share)
    budget = cache.budget
    # the policy's own protected set (recent window, sinks), asked of the rule the cache evicts by
    guarded = protected(torch.arange(seen).view(1, 1, -1), torch.tensor([seen - 1]), budget)[0, 0].tolist()
    classes = []
    for index in range(token_count):
        if index >= seen or guarded[index] or not budget.evicts:
            classes.append(RECENT if index >= seen or share[index] > 0 else EVICTED)
        elif index in recalled:  # what the cold tier gave back is the point of it: shown first
            classes.append(RECALLED)
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
    """What each mark counts, in tokens of the conversation. A token is held, or not, in each
    (layer, KV head) cache separately: the marks say in how many of them."""
    classes = token_classes(cache, ids_count)
    caches = sum(layer.token_index.shape[1] for layer in cache.layers if layer.is_initialized)
    recall = []
    if has_cold_tier(cache):
        counts = recall_slot_counts(cache)
        mean = float(counts[counts > 0].float().mean()) if bool((counts > 0).any()) else 0.0
        recall = [(RECALLED, f"recalled (in a recall slot of at least one of them now, {amount(round(mean, 1))} "
                             "of them on average; marked before heavy)")]
    legend = Text(f"{ids_count} tokens, each held or not in each of the {caches} layer × KV head caches:   ")
    for name, label in ((HEAVY, "heavy hitter (held on merit in at least half of them)"), *recall,
                        (PARTIAL, "partly evicted (held in fewer than half)"),
                        (RECENT, "recent window / sinks (never evicted)"), (EVICTED, "evicted (held in none)")):
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
