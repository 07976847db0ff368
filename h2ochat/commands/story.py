"""`h2ochat story`: one long continuation, far past the budget and the model's position limit.

The cache keeps a fixed number of slots and re-numbers positions when they run out (compact
positions), so memory stays flat however long the story gets. ``--out`` receives the text as it
is produced, so an interrupted run loses nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

import h2ochat_prompts

from .. import options as o
from ..chat import inference_steps, stop_token_ids
from ..errors import EXIT_INTERRUPTED, user_errors
from ..generation import Sampling, TextStream, Timing, stream
from ..models import load
from ..prompting import encode
from ..ui import ReplyPrinter, format_bytes, make_console, status_line


def tell(model, tokenizer, cache, input_ids, *, tokens: int, sampling: Sampling, stop_ids=frozenset(),
         prefill_chunk: int = 512, timing: Timing | None = None) -> Iterator[str]:
    """Text pieces of a continuation of ``input_ids`` [1, T], ``tokens`` long unless a stop id comes."""
    pieces = TextStream(tokenizer)
    steps = stream(model, cache, input_ids, max_new_tokens=tokens, sampling=sampling, stop_ids=stop_ids,
                   prefill_chunk=prefill_chunk, timing=timing)
    for step in inference_steps(steps):
        yield pieces.push(step.tokens[0])


@user_errors
def story(
    prompt: Annotated[Optional[str], typer.Option("--prompt", rich_help_panel=o.OUTPUT,
        help="The opening of the story.")] = None,
    prompt_file: Annotated[Optional[str], typer.Option("--prompt-file", "-f", rich_help_panel=o.OUTPUT,
        help="A file with the opening, or a shipped opening by name: "
             + ", ".join(h2ochat_prompts.names("story")) + ". Default: lighthouse.")] = None,
    tokens: Annotated[int, typer.Option("--tokens", min=1, envvar="H2OCHAT_STORY_TOKENS", rich_help_panel=o.SAMPLING,
        help="Tokens to generate.")] = 3000,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", rich_help_panel=o.OUTPUT,
        help="Also write the story (opening included) to this file as it is produced.")] = None,
    chat: Annotated[bool, typer.Option("--chat/--raw", rich_help_panel=o.OUTPUT,
        help="Ask the model for a story through its chat template instead of continuing the text as is.")] = False,
    stop_at_eos: Annotated[bool, typer.Option("--stop-at-eos", rich_help_panel=o.SAMPLING,
        help="End when the model writes an end-of-text token (by default it keeps going).")] = False,
    model: o.Model = o.DEFAULTS["model"],
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    device_map: o.DeviceMap = None,
    budget: o.Budget = "0.05",
    policy: o.Policy = "h2o",
    heavy_ratio: o.HeavyRatio = 0.5,
    sinks: o.Sinks = 4,
    positions: o.Positions = "compact",
    prefill_chunk: o.PrefillChunk = o.DEFAULTS["prefill_chunk"],
    temperature: o.Temperature = 0.8,
    top_p: o.TopP = 0.95,
    top_k: o.TopK = 0,
    seed: o.Seed = None,
    repetition_penalty: o.RepetitionPenalty = 1.0,
):
    """Stream a long story in constant KV memory, with the cache's state live under it."""
    if prompt is not None and prompt_file is not None:
        raise ValueError("give --prompt or --prompt-file, not both")
    opening = prompt if prompt is not None else h2ochat_prompts.read(prompt_file or "lighthouse", "story")
    if not opening.strip():
        raise ValueError("the story opening is empty")
    settings = o.cache_settings(policy, budget, heavy_ratio, sinks, positions, seed)
    sampling = o.sampling(temperature, top_p, top_k, seed, repetition_penalty)
    err = make_console(stderr=True)
    with (err.status(f"loading {model}…") if err.is_terminal else _nothing()):
        loaded = load(model, device, dtype, device_map)
    tokenizer = loaded.tokenizer
    if chat:
        request = f"Write a long story that begins like this:\n\n{opening}"
        input_ids = encode(tokenizer, request, chat=True)
    else:
        input_ids = encode(tokenizer, opening, chat=False)
    cache = settings.build(loaded.model)
    stops = stop_token_ids(tokenizer, loaded.model) if stop_at_eos else frozenset()
    timing = Timing()
    console = make_console()
    sink = out.open("w", encoding="utf-8") if out else None
    peak_kv = 0
    interrupted = False
    try:
        if sink:
            sink.write(opening)
            sink.flush()
        status = lambda: status_line(cache, timing if timing.generated_tokens else None, live=True)  # noqa: E731
        with ReplyPrinter(console, status) as printer:
            if not chat:
                printer.write(opening)
            try:
                for piece in tell(loaded.model, tokenizer, cache, input_ids.to(loaded.device), tokens=tokens,
                                  sampling=sampling, stop_ids=stops, prefill_chunk=prefill_chunk, timing=timing):
                    peak_kv = max(peak_kv, cache.kv_bytes())
                    printer.write(piece)
                    if sink:
                        sink.write(piece)
                        sink.flush()
            except KeyboardInterrupt:
                interrupted = True
    finally:
        if sink:
            sink.write("\n")
            sink.close()
    err.print(f"{timing.generated_tokens} tokens at {timing.decode_tokens_per_s:.1f} tok/s · KV peak "
              f"{format_bytes(peak_kv)} for {cache.budget.slots} slots (a full cache would now hold "
              f"{format_bytes(cache.full_kv_bytes())}) · {cache.tokens_seen()} tokens seen of a "
              f"{cache.max_positions}-position model · positions re-numbered {cache.compactions}×"
              + (f" · written to {out}" if out else "") + (" · interrupted" if interrupted else ""),
              style="dim", markup=False, highlight=False)
    if interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)


def _nothing():
    from contextlib import nullcontext

    return nullcontext()


def register(app: typer.Typer) -> None:
    app.command("story")(story)
