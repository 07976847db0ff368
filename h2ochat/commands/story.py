"""`h2ochat story`: long continuations, far past the budget and the model's position limit.

The cache keeps a fixed number of slots and re-numbers positions when they run out (compact
positions), so memory stays flat however long the story gets, and reading an existing story of any
length (``--continue``) costs the same memory as writing one: the text goes through the cache in
chunks. ``-n N`` writes N continuations of one opening as one batch, each row drawing from its own
seeded stream. Every story is written to its file as it is produced, so an interrupted run loses
nothing; the run ends with one summary line, including how repetitive the end of each story is
against its start (distinct 4-grams), so degeneration shows as a number.

``--continue`` only ever appends: the story file is locked while the continuation is written, read
again once the model has loaded (so text appended meanwhile is read, and kept), and its bytes are
never rewritten, trailing whitespace included.

On an accelerator the generated tokens are read back in bursts (one host read per
``stop_check_interval`` tokens, not one per token), and the speed is measured at those read-backs:
the time the device took, not the time the host took to queue the work.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import replace
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.text import Text

import h2ochat_prompts

from .. import options as o
from ..config import DEFAULT_PREFILL_CHUNK, CacheSettings
from ..chat.settings import check_fits
from ..chat.replies import stop_token_ids
from ..errors import EXIT_INTERRUPTED, UserError, one_line, strict_user_errors, user_input
from ..loading.models import load
from ..chat.prompting import encode
from ..measure.textstats import repetition
from ..chat.ui import ReplyPrinter, TokenProgress
from ..console import make_console
from .common import RepeatLastN, compiling_note, loading
from ..chat.history import refuse_replacing
from .story_files import appending, check_writable, output_paths, read_story

# the generation, status and row modules import torch: they are imported when the command runs
# (--help stays fast)

# Defaults chosen by measurement (benchmarks/results_story_repetition.json, README "Long stories"):
# SmolLM2-135M, 2000 tokens, budget 256, temperature 0.7.
STORY_REPETITION_PENALTY = 1.1
STORY_REPEAT_LAST_N = 64
TAIL_SHOWN = 400  # characters of a continued story shown on a terminal before the new text


@strict_user_errors
@o.takes_cache_options(budget="0.05")
def story(
    prompt: Annotated[Optional[str], typer.Option("--prompt", rich_help_panel=o.OUTPUT,
        help="The opening of the story.")] = None,
    prompt_file: Annotated[Optional[str], typer.Option("--prompt-file", "-f", rich_help_panel=o.OUTPUT,
        help="A file with the opening, or a shipped opening by name: "
             + ", ".join(h2ochat_prompts.names("story")) + ". Default: lighthouse.")] = None,
    continue_from: Annotated[Optional[Path], typer.Option("--continue", "-c", rich_help_panel=o.OUTPUT,
        help="Read this story (any length: it goes through the cache in chunks) and append a continuation "
             "to it.")] = None,
    tokens: Annotated[int, typer.Option("--tokens", min=1, envvar="H2OCHAT_STORY_TOKENS", rich_help_panel=o.SAMPLING,
        help="Tokens to generate (per story).")] = 3000,
    count: Annotated[int, typer.Option("--count", "-n", min=1, rich_help_panel=o.OUTPUT,
        help="Write N continuations of the opening in one batch, each with its own random stream "
             "(seeds SEED, SEED+1, ...); --out story.txt gives story-1.txt ... story-N.txt.")] = 1,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", rich_help_panel=o.OUTPUT,
        help="Also write the story (opening included) to this file as it is produced. An existing file is "
             "refused unless --force is given (--continue FILE adds to one).")] = None,
    force: Annotated[bool, typer.Option("--force", rich_help_panel=o.OUTPUT,
        help="Let --out replace a file that exists.")] = False,
    chat: Annotated[bool, typer.Option("--chat/--raw", rich_help_panel=o.OUTPUT,
        help="Ask the model for a story through its chat template instead of continuing the text as is.")] = False,
    stop_at_eos: Annotated[bool, typer.Option("--stop-at-eos", rich_help_panel=o.SAMPLING,
        help="End a story when the model writes an end-of-text or end-of-turn token (by default it keeps "
             "going).")] = False,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=o.OUTPUT,
        help="Print one JSON object (stories, speed, repetition, cache) instead of the text.")] = False,
    model: o.Model = o.DEFAULTS["model"],
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    device_map: o.DeviceMap = None,
    settings: CacheSettings = None,  # the cache options and --prefill-chunk, checked (o.takes_cache_options)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    temperature: o.Temperature = 0.8,
    top_p: o.TopP = 0.95,
    top_k: o.TopK = 0,
    seed: o.Seed = None,
    repetition_penalty: o.RepetitionPenalty = STORY_REPETITION_PENALTY,
    repeat_last_n: RepeatLastN = STORY_REPEAT_LAST_N,
    compile: o.Compile = False,
):
    """Stream a long story in constant KV memory, with the cache's state live under it."""
    if sum(x is not None for x in (prompt, prompt_file, continue_from)) > 1:
        raise UserError("give one of --prompt, --prompt-file or --continue")
    if continue_from is not None:
        if out is not None or count > 1 or chat:
            raise UserError("--continue appends to its own file; it takes no --out, -n or --chat")
        check_writable(continue_from)
        opening = read_story(continue_from)  # read again, under the lock, once the model is loaded
        paths: list[Path | None] = [continue_from]
    else:
        opening = prompt if prompt is not None else h2ochat_prompts.read(prompt_file or "lighthouse", "story")
        paths = output_paths(out, count) if out else [None] * count
        for path in paths:
            if path is not None:
                if not force:  # a story is hours of generation: re-running a command must not write it away
                    refuse_replacing(path, f"--force replaces it, --continue {path} adds to it, or give another --out")
                check_writable(path)  # before the model loads
    if not opening.strip():
        raise UserError("the story opening is empty")
    sampling = replace(o.sampling(temperature, top_p, top_k, seed, repetition_penalty), repeat_last_n=repeat_last_n)
    from ..chat.status import StatusLine
    from ..engine.generation import Timing, inference_steps, stop_check_interval, stream
    from .story_report import story_record, summary_line
    from .story_rows import Row, read_in_bursts, read_long_text

    with user_input():
        sampling.validate()
    err = make_console(stderr=True)
    with loading(err, model):
        loaded = load(model, device, dtype, device_map, kv_slots=settings.kv_slots_needed(prefill_chunk),
                      kv_batch=count)
    check_fits(settings, loaded.model)
    if compile:
        err.print(f"note: {compiling_note()}", style="dim", markup=False, highlight=False)
    with ExitStack() as held:
        story_file = None
        if continue_from is not None:  # locked, then read as it is now: text appended meanwhile is kept and read
            story_file = held.enter_context(appending(continue_from))
            opening = read_story(continue_from)
        tokenizer = loaded.tokenizer
        if chat:
            input_ids = encode(tokenizer, f"Write a long story that begins like this:\n\n{opening}", chat=True)
        else:  # the model picks up after the last word (a file's trailing whitespace stays in the file)
            input_ids = encode(tokenizer, opening.rstrip() if story_file is not None else opening, chat=False)
        input_ids = input_ids.to(loaded.device).expand(count, -1)
        if count > 1:
            sampling = sampling.with_row_seeds(count, loaded.device)
        cache = settings.build(loaded.model)
        stops = stop_token_ids(tokenizer, loaded.model) if stop_at_eos else frozenset()

        console = make_console()
        # one story streams to standard output; several are printed whole at the end (interleaved text
        # would be unreadable), as is a JSON record
        streaming = count == 1 and not as_json
        rows = [Row(tokenizer, path, keep_text=not streaming, context=input_ids[0].tolist()) for path in paths]
        embedded = streaming and console.is_terminal
        progress = TokenProgress(console if embedded else err, embedded=embedded)
        read_so_far = 0  # tokens of the opening read: the status figures are read again when it or the story moves
        figures = StatusLine(lambda: cache, lambda: (read_so_far, sum(len(row.tokens) for row in rows)))
        status = lambda: Group(progress.renderable, Text(figures(), style="dim"))  # noqa: E731
        timing = Timing()
        total = input_ids.shape[1]
        # the repetition window must see the text's last tokens, so they go through `stream`
        window = (total if repeat_last_n <= 0 else repeat_last_n) if repetition_penalty != 1.0 else 1
        keep = min(total, max(window, 1))
        interrupted = False
        read_s = gen_s = 0.0
        printer = ReplyPrinter(console, status) if streaming else None

        def on_read(done: int) -> None:
            nonlocal read_so_far
            read_so_far = done
            progress.update(done)
            shown.tick()

        try:
            for row in rows:
                if story_file is not None:
                    row.append_to(story_file, opening)
                else:
                    row.open(opening)
            with progress, (printer or _Quiet()) as shown:
                if streaming and not chat:
                    if story_file is None:
                        shown.write(opening)
                    elif console.is_terminal:  # the file has the rest; show where the story stands
                        shown.write(("…" if len(opening) > TAIL_SHOWN else "") + opening[-TAIL_SHOWN:])
                started = time.perf_counter()
                try:
                    if total > keep:
                        progress.phase("reading", total)
                        tail = read_long_text(loaded.model, cache, input_ids, keep, prefill_chunk, on_read)
                    else:
                        tail = input_ids
                    every = stop_check_interval(loaded.device)
                    steps = stream(loaded.model, cache, tail, max_new_tokens=tokens, sampling=sampling, stop_ids=stops,
                                   prefill_chunk=prefill_chunk, timing=timing, compile=compile, stop_check_every=every)
                    first_read = last_read = None  # host clock at the first and the latest read-back
                    written_at_first = 0
                    for burst in read_in_bursts(inference_steps(steps), every):
                        last_read = time.perf_counter()  # the device has finished these steps
                        if first_read is None:
                            read_s = last_read - started
                            first_read = started = last_read
                            progress.phase("writing" if count == 1 else f"writing {count} stories", tokens * count)
                        for row_tokens in burst:
                            for row, token in zip(rows, row_tokens):
                                if row.done:
                                    continue
                                if token in stops:
                                    row.stop()
                                    continue
                                piece = row.take(token)
                                if streaming:
                                    shown.write(piece)
                        progress.update(sum(len(row.tokens) for row in rows))
                        if last_read == first_read:
                            written_at_first = sum(len(row.tokens) for row in rows)
                except KeyboardInterrupt:
                    interrupted = True
                gen_s = time.perf_counter() - started if timing.generated_tokens else 0.0
        finally:
            for row in rows:
                row.close()

        written = sum(len(row.tokens) for row in rows)
        # decode speed at the read-backs (the device's time, not the host's queueing): the tokens after
        # the first burst over the time from its read-back to the last (a single burst: the host's clock)
        device_s = last_read - first_read if first_read is not None else 0.0
        if device_s > 0 and written > written_at_first:
            rate = (written - written_at_first) / device_s
        else:
            rate = (written - count) / timing.decode_s if timing.decode_s > 0 and written > count else 0.0
        checks = [repetition(row.tokens) for row in rows]
        if as_json:
            record = story_record(loaded, cache, settings.budget, rows, checks, timing, total, read_s, gen_s, rate, interrupted)
            print(json.dumps(record, indent=2, ensure_ascii=False))
        elif not streaming:
            for index, row in enumerate(rows, 1):
                console.print(Text(f"── story {index} of {count}" + (f" · {row.path}" if row.path else "") + " ──",
                                   style="bold"))
                sys.stdout.write(("" if chat else opening) + row.text + "\n\n")
                sys.stdout.flush()
        err.print(summary_line(cache, rows, checks, total, read_s, gen_s, rate, continue_from is not None, interrupted),
                  style="dim", markup=False, highlight=False, soft_wrap=True)  # one line, wrapped by the terminal
        failed = [row for row in rows if row.write_error is not None]
        if failed:
            kept = "in the JSON above" if as_json else "above, on standard output"
            raise UserError("; ".join(f"could not write {row.path}: {row.write_error.strerror or one_line(row.write_error)}" for row in failed)
                            + f" (the story is {kept})")
        if interrupted:
            raise typer.Exit(EXIT_INTERRUPTED)


class _Quiet:
    """Stands in for the ReplyPrinter when nothing streams to standard output."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def write(self, piece: str) -> None:
        pass

    def tick(self) -> None:
        pass


def register(app: typer.Typer) -> None:
    app.command("story")(story)
