"""`h2ochat serve`: the OpenAI-compatible HTTP server (h2ochat/serve/)."""

from __future__ import annotations

import re
from typing import Annotated, Optional

import typer

from .. import options as o
from ..config import DEFAULT_PREFILL_CHUNK, CacheSettings
from ..sizes import parse_size
from ..errors import UserError, strict_user_errors
from ..loading.sources import resolve
from .common import RepeatLastN

SERVER = "Server"
# a prompt this long takes about a minute to read for a 135M model on a laptop CPU (~500 tok/s): past
# it, one request would hold its row for minutes (a 250,000-token message was read for 5.5 minutes)
DEFAULT_MAX_PROMPT_TOKENS = 32768
ZERO_SIZE = re.compile(r"\s*0*\.?0+\s*[a-z]*\s*", re.IGNORECASE)  # 0, 0GiB, 0.0 MB: a size of nothing


def _size(text: str | None, option: str) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError:
        raise UserError(f"{option} must be a size like 2GiB, 512MiB or 1.5GB, got {text!r}") from None


@strict_user_errors
@o.takes_cache_options
def serve(
    model: o.Model = o.DEFAULTS["model"],
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    random_weights: o.RandomWeights = False,
    settings: CacheSettings = None,  # the cache options and --prefill-chunk, checked (o.takes_cache_options)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    repetition_penalty: o.RepetitionPenalty = 1.0,
    repeat_last_n: RepeatLastN = 64,
    compile: o.ServeCompile = None,
    mixed_steps: o.ServeMixedSteps = True,
    host: Annotated[str, typer.Option("--host", rich_help_panel=SERVER,
        help="Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, rich_help_panel=SERVER)] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="H2OCHAT_API_KEY", rich_help_panel=SERVER,
        help="Require 'Authorization: Bearer KEY' (without it any token, or none, is accepted).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", rich_help_panel=SERVER,
        help="The model id clients send and /v1/models lists (default: --model as given).")] = None,
    max_sequences: Annotated[Optional[int], typer.Option("--max-sequences", min=1, rich_help_panel=SERVER,
        help="Sequence rows of the batch (concurrent generations). Default: --kv-memory (or half the free memory) "
             "divided by one row's KV bytes (its slots, recall's included), at most 64.")] = None,
    kv_memory: Annotated[Optional[str], typer.Option("--kv-memory", rich_help_panel=SERVER,
        help="KV memory for the rows when --max-sequences is not given (2GiB, 512MiB): their slots, on any device, "
             "with recall or without (recall's cold stores are bounded by --recall-memory).")] = None,
    recall_memory: Annotated[Optional[str], typer.Option("--recall-memory", rich_help_panel=SERVER,
        help="Host memory for recall's cold stores (the evicted tokens of every row), which grow by pages as "
             "conversations get long; at the bound further evicted tokens are dropped, as without recall. "
             "Default: half the host memory free beside the rows, at most 4GiB. (--recall 0 serves without "
             "recall.)")] = None,
    parked_bytes: Annotated[str, typer.Option("--parked-bytes", rich_help_panel=SERVER,
        help="Host memory for the caches of finished conversations, kept so the next turn feeds only its new "
             "tokens (least recently used out first).")] = "1GiB",
    prefill_chunks_per_step: Annotated[int, typer.Option("--prefill-chunks-per-step", min=1, rich_help_panel=SERVER,
        help="Prompt chunks (--prefill-chunk tokens each) the engine reads between two decode steps while requests "
             "wait: more let newcomers join the batch sooner (more tokens/s under load), and the running streams "
             "wait longer between two tokens.")] = 1,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, rich_help_panel=SERVER,
        help="Requests waiting for a row at most; more are answered 429 with Retry-After.")] = 64,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, rich_help_panel=SERVER,
        help="Tokens one request may generate at most (also the default when it gives no max_tokens).")] = 4096,
    max_prompt_tokens: Annotated[int, typer.Option("--max-prompt-tokens", min=0, rich_help_panel=SERVER,
        help="Prompt tokens one request may bring at most (the whole conversation it sends); longer is answered 400 "
             "before any of it is read. 0: no limit.")] = DEFAULT_MAX_PROMPT_TOKENS,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", rich_help_panel=SERVER,
        help="No line per request on stderr (id, tokens in and out, cached and evicted tokens, time, finish "
             "reason); start-up lines and failed requests are still logged.")] = False,
):
    """Serve the OpenAI API (chat and text completions, streaming) with every sequence in a fixed KV budget."""
    from ..loading.cache_dirs import persistent_compile_cache
    from ..serve.server import ServeConfig, serve as run_server

    persistent_compile_cache()  # (before torch is imported: a second start reuses the first's graphs)

    if served_model_name is not None and not served_model_name.strip():
        raise UserError("--served-model-name must not be empty: it is the model id clients send")
    if not random_weights:
        resolve(model)  # an unknown model is refused before the server starts listening
    o.sampling(0.0, 1.0, 0, None, repetition_penalty)
    if recall_memory is not None and ZERO_SIZE.fullmatch(recall_memory):
        raise UserError(f"--recall-memory {recall_memory} keeps no evicted token: give a size (512MiB, 4GiB), or "
                        "--recall 0 to serve without recall")
    recall_bytes = _size(recall_memory, "--recall-memory")
    config = ServeConfig(model=model, settings=settings, device=device, dtype=dtype, random_weights=random_weights,
                         served_name=served_model_name, max_sequences=max_sequences,
                         kv_memory=_size(kv_memory, "--kv-memory"), recall_memory=recall_bytes,
                         parked_bytes=_size(parked_bytes, "--parked-bytes"),
                         max_queue=max_queue, max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens, prefill_chunk=prefill_chunk,
                         prefill_chunks_per_step=prefill_chunks_per_step,
                         repetition_penalty=repetition_penalty, repeat_last_n=repeat_last_n, compile=compile,
                         mixed_steps=mixed_steps,
                         host=host, port=port, api_key=api_key, quiet=quiet)
    status = run_server(config)  # 130 when stopped by SIGINT, 0 by SIGTERM
    if status:
        raise typer.Exit(status)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
