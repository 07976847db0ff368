"""What a story run reports: the one summary line on standard error (speed, the cache's slots and
memory, re-numberings, the attention evicted tokens held, how repetitive each story is) and the
``--json`` record."""

from __future__ import annotations

from ..chat.report import cache_record, cache_stats_record, evicted_share, part_shares, peak_memory_bytes
from ..chat.split import cache_split, describe_memory, describe_slots, kv_memory, layer_splits
from ..chat.status import percent
from ..chat.ui import format_duration
from ..engine.generation import Timing
from ..measure.textstats import batch_summary
from .story_rows import Row


def summary_line(cache, rows: list[Row], checks, read_tokens: int, read_s: float, gen_s: float, rate: float,
                 continued: bool, interrupted: bool) -> str:
    count = len(rows)
    written = sum(len(row.tokens) for row in rows)
    parts = []
    if continued:
        parts.append(f"read {read_tokens} tokens in {format_duration(read_s)}")
    what = f"{written} tokens" if count == 1 else f"{count} stories, {written} tokens"
    parts.append(f"{what} in {format_duration(gen_s)} at {rate:.1f} tok/s" + (" (all stories together)" if count > 1 else ""))
    splits = layer_splits(cache)
    parts.append(f"{describe_slots(cache_split(cache, splits), ' per layer and KV head')}: "
                 f"{describe_memory(kv_memory(cache, splits))}")
    parts.append(f"{cache.longest_row_tokens()} tokens seen · positions re-numbered {cache.compactions}×")
    share = evicted_share(cache)
    if share is not None:
        parts.append(f"evicted tokens held {percent(share)} of the attention when dropped")
    if count == 1:
        parts.append(checks[0].summary())
    else:
        parts.append(batch_summary(checks))
    files = [str(row.path) for row in rows if row.path is not None]
    if files:
        parts.append(("appended to " if continued else "written to ") + (files[0] if count == 1 else f"{files[0]} … {files[-1]}"))
    if interrupted:
        parts.append("interrupted")
    return " · ".join(parts)


def story_record(loaded, cache, budget: str, rows: list[Row], checks, timing: Timing, read_tokens: int,
                 read_s: float, gen_s: float, rate: float, interrupted: bool) -> dict:
    def parts(row: Row) -> list[tuple[str, int, int]]:
        return [("opening", 0, read_tokens), ("story", read_tokens, read_tokens + len(row.tokens))]

    return {
        "model": loaded.name,
        "budget": budget,
        **cache_record(cache),
        "prompt_tokens": read_tokens,
        "read_s": round(read_s, 3),
        "generated_tokens": sum(len(row.tokens) for row in rows),
        "generate_s": round(gen_s, 3),
        "decode_tokens_per_s": round(rate, 2),
        "tokens_seen": cache.longest_row_tokens(),
        "peak_memory_bytes": peak_memory_bytes(loaded.device),
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "interrupted": interrupted,
        "cache_stats": cache_stats_record(cache, parts(rows[0])),  # parts: the first story's
        "stories": [{"file": str(row.path) if row.path else None, "text": row.text if row.text_parts is not None else None,
                     "generated_tokens": len(row.tokens), "repetition": check.to_json(),
                     "held": part_shares(cache, parts(row), index)}
                    for index, (row, check) in enumerate(zip(rows, checks))],
    }
