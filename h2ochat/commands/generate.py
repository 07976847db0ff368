"""`h2ochat generate`: one prompt in, text (or one JSON object) out."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import options as o
from ..config import DEFAULT_PREFILL_CHUNK, CacheSettings
from ..errors import EXIT_INTERRUPTED, UserError, strict_user_errors, user_input
from ..chat.prompting import read_prompt
from .common import RepeatLastN, compiling_note, loading

# the model, generation and report modules are imported when the command runs (--help stays fast)


@strict_user_errors
@o.takes_cache_options
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt; '-' reads standard input.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", "-f", rich_help_panel=o.OUTPUT,
        help="Read the prompt from a file.")] = None,
    raw: Annotated[bool, typer.Option("--raw", rich_help_panel=o.SAMPLING,
        help="Continue the text as is instead of wrapping it in the model's chat template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", rich_help_panel=o.SAMPLING, help="System prompt (chat template).")] = None,
    model: o.Model = o.DEFAULTS["model"],
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    random_weights: o.RandomWeights = False,
    device_map: o.DeviceMap = None,
    settings: CacheSettings = None,  # the cache options and --prefill-chunk, checked (o.takes_cache_options)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    max_new_tokens: o.MaxNewTokens = 256,
    temperature: o.Temperature = 0.0,
    top_p: o.TopP = 1.0,
    top_k: o.TopK = 0,
    seed: o.Seed = None,
    repetition_penalty: o.RepetitionPenalty = 1.0,
    repeat_last_n: RepeatLastN = 64,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", rich_help_panel=o.SAMPLING,
        help="Generate exactly --max-new-tokens tokens: do not stop at end-of-text or end-of-turn tokens.")] = False,
    as_json: o.Json = False,
    compile: o.Compile = False,
):
    """Generate from one prompt through the H2O cache and stream the text (or print JSON)."""
    text = read_prompt(prompt, prompt_file)  # a bad prompt or option fails here, before the model loads
    sampling = replace(o.sampling(temperature, top_p, top_k, seed, repetition_penalty), repeat_last_n=repeat_last_n)
    with user_input():
        sampling.validate()
    from ..loading import models
    from .. import threads
    from ..chat.settings import check_fits
    from ..chat.replies import stop_token_ids
    from ..engine.detokenize import TextStream
    from ..engine.generation import Timing, decoder, stop_check_interval, stream
    from ..chat.prompting import encode
    from ..chat.report import evictions, run_record
    from ..console import make_console

    with loading(make_console(stderr=True), model):
        loaded = models.load(model, device, dtype, device_map, random_weights=random_weights,
                             kv_slots=settings.kv_slots_needed(prefill_chunk), check_config=o.fits_window(settings))
    check_fits(settings, loaded.model)  # the budget against this model's window, in one line
    tokenizer = loaded.tokenizer
    input_ids = encode(tokenizer, text, chat=False if raw else None, system=system).to(loaded.device)
    if input_ids.shape[1] == 0:
        raise UserError("the prompt is empty once tokenized")
    cache, recall_left_out = settings.build_for(loaded.model, input_ids.shape[1] + max_new_tokens)
    timing, pieces = Timing(), TextStream(tokenizer, context=input_ids[0].tolist())  # the first word joins the prompt
    # the same rule as run and story --stop-at-eos
    stops = frozenset() if ignore_eos else stop_token_ids(tokenizer, loaded.model)
    interrupted = False
    from ..chat.prompt_progress import PromptProgress

    reading = PromptProgress(make_console(stderr=True), cache, input_ids.shape[1])
    decode = decoder(loaded.model, compile)
    if compile:
        print(f"note: {compiling_note()}", file=sys.stderr, flush=True)
    try:
        with reading:
            for step in stream(loaded.model, cache, input_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                               stop_ids=stops, prefill_chunk=prefill_chunk, timing=timing, decode=decode,
                               stop_check_every=stop_check_interval(loaded.device), should_stop=reading.should_stop):
                piece = pieces.push(step.tokens[0])
                if not as_json:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
    except KeyboardInterrupt:
        interrupted = True
    if as_json:
        record = run_record(loaded, cache, timing, settings.budget, pieces.text)
        record["interrupted"] = interrupted
        record["threads"] = threads.current()
        if recall_left_out:  # (asked for, or on by default)
            record["recall_left_out"] = "the prompt and --max-new-tokens fit the policy's slots: nothing is evicted"
            record["recall_asked"] = recall_asked(settings, cache, input_ids.shape[1] + max_new_tokens)
        # the compiled step's weights: frozen into its graph (CPU) or graph inputs, and why
        record["compiled_weights"] = getattr(decode, "freezing", None) if compile else None
        print(json.dumps(record, indent=2))
    else:
        sys.stdout.write("\n")
        if recall_left_out and settings.recall not in (None, "auto"):  # asked for in words: say why it is not used
            asked = recall_asked(settings, cache, input_ids.shape[1] + max_new_tokens)
            print(f"note: --recall {settings.recall} ({asked['recall_slots']} recall slots) was not used: "
                  f"{asked['why']}", file=sys.stderr)
        if sys.stderr.isatty():
            print(f"[{timing.prompt_tokens} prompt tokens at {timing.prefill_tokens_per_s:.1f} tok/s, "
                  f"{timing.generated_tokens} generated at {timing.decode_tokens_per_s:.1f} tok/s, "
                  + (f"{timing.steady_decode_tokens_per_s:.1f} tok/s after the first step's {timing.first_step_s:.1f} s "
                     "of compilation, " if compile and timing.first_step_s is not None else "") +
                  f"{evictions(cache)}]", file=sys.stderr)
    if interrupted:
        print(reading.stopped(timing.generated_tokens), file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED)


def recall_asked(settings: CacheSettings, cache, tokens: int) -> dict:
    """What --recall asked for, beside what the cache used (``generate`` leaves recall out when the
    prompt and --max-new-tokens, ``tokens`` in all, fit the policy's slots): the JSON's split figures
    are the cache's, so a user checking whether --recall took effect reads here why it did not."""
    slots = max(layer.capacity for layer in cache.layers)
    config = settings.recall_config(slots)
    return {"recall": settings.recall if settings.recall is not None else "auto",
            "recall_slots": config.slots if config is not None else 0, "recall_slots_used": 0,
            "why": f"the prompt and --max-new-tokens ({tokens:,} tokens at most) fit the {slots:,} slots: nothing "
                   "is evicted, so nothing could be recalled, and the same tokens come out faster without it "
                   "(`run` keeps recall on: a chat grows)"}


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
