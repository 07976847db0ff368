"""The chat's two views of the cache: ``/cache`` (where the budget hurts, per layer and per part of the
conversation, and the cold tier with --recall) and ``/hh`` (the conversation's tokens marked by where
they stand: heavy hitters, recent, recalled, evicted). They read the cache and return Rich
renderables; nothing changes state.
"""

from __future__ import annotations

import torch
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..kv import H2OCache
from ..policies import protected
from ..recall.report import TierSummary, has_cold_tier, recall_slot_counts
from .report import part_shares
from .split import Split, amount, describe_memory, describe_slots, describe_use, format_bytes
from .status import CacheSummary, percent, summarize


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
