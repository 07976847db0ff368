"""Wiring: the engine's load function (model, rows, backend) and uvicorn around the application."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from .. import threads
from ..chat.conversation import stop_token_ids
from ..errors import EXIT_INTERRUPTED, UserError
from ..engine.generation import CacheSettings, max_positions
from ..engine.packed_linears import form_of, pack_linears
from ..loading.cache_dirs import persistent_compile_cache
from ..loading.models import available_memory, load, random_source, shipped_config, shipped_config_path
from ..chat.split import format_bytes
from ..recall.cold_bound import DEFAULT_LIMIT as DEFAULT_RECALL_MEMORY, ColdBound
from .app import build_app
from .backend import ModelBackend
from .engine import Engine, Loaded
from .metrics import Metrics
from .parked import ParkedStore
from .prepare import Preparer

log = logging.getLogger("h2ochat.serve")

AUTO_MEMORY_SHARE = 0.5  # of the memory free after loading, for the batch rows when --max-sequences is not given
# the rows' memory when neither --max-sequences nor --kv-memory is given: half the free memory took
# 3.5-4.1 GB of RSS for a 135M model on a 24 GB machine, more than a laptop user expects of it
DEFAULT_KV_MEMORY = 1 << 30
AUTO_MAX_ROWS = 64
# the recall tier's cold stores when --recall-memory is not given: half the host memory free beside the rows, at
# most DEFAULT_RECALL_MEMORY (recall.cold_bound)
GRACEFUL_SHUTDOWN_S = 10  # for the responses the engine failed to be sent (its last step must end first)
ENGINE_STOP_S = 10  # for the engine thread to end its step after the server stopped


@dataclass
class ServeConfig:
    model: str
    settings: CacheSettings
    device: str = "auto"
    dtype: str = "auto"
    random_weights: bool = False
    served_name: str | None = None
    max_sequences: int | None = None  # None: from memory
    kv_memory: int | None = None  # bytes for the rows when max_sequences is None (None: half the free memory)
    recall_memory: int | None = None  # bound on the recall tier's cold stores (None: ``choose_recall_memory``)
    parked_bytes: int = 1 << 30
    max_queue: int = 64
    max_tokens: int = 4096
    max_prompt_tokens: int = 0  # prompt tokens a request may bring (0: no limit; the command's default is 32,768)
    prefill_chunk: int = 512
    prefill_chunks_per_step: int = 1  # prompt chunks one engine step may read before its decode step
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    compile: bool | None = False  # None: when the step covers the rows (serve.backend.compiles_by_default)
    compile_backend: str | None = None
    mixed_steps: bool = True  # a prompt chunk and the decode step in one forward (serve.backend.ModelBackend.mixes)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    quiet: bool = False  # no line per request on stderr


def choose_rows(config: ServeConfig, row_bytes: int, device) -> tuple[int, str]:
    """N, and in plain words where it came from (the start-up log says it). The rows' device KV (their slots,
    recall's columns included) is what --kv-memory counts, on every device, with recall or without, as vLLM
    counts its KV space; a recall tier's cold stores have their own bound (``choose_recall_memory``). Without
    --max-sequences or --kv-memory the rows get DEFAULT_KV_MEMORY (or half the free memory, when that is less):
    what a laptop can spare beside its other programs. A memory that holds no row is refused: a row over the
    cap would break the cap it was given."""
    each = f"{format_bytes(row_bytes)} of KV slots each"
    if config.max_sequences:
        return config.max_sequences, f"--max-sequences: {each}, {format_bytes(config.max_sequences * row_bytes)} in all"
    if config.kv_memory:
        budget, source = config.kv_memory, f"--kv-memory {format_bytes(config.kv_memory)}"
    else:
        half_free = int(AUTO_MEMORY_SHARE * available_memory(str(device)))
        budget = min(DEFAULT_KV_MEMORY, half_free)
        source = (f"the default {format_bytes(budget)}; --kv-memory or --max-sequences for more" if budget < half_free
                  else f"half the free memory, {format_bytes(budget)}")
    if budget < row_bytes:
        raise UserError(_no_row(source, row_bytes))
    rows = budget // row_bytes
    capped = rows > AUTO_MAX_ROWS
    rows = min(rows, AUTO_MAX_ROWS)
    return rows, (f"{each}, {format_bytes(rows * row_bytes)} in all, from {source}"
                  + (f"; at most {AUTO_MAX_ROWS}" if capped else ""))


def choose_recall_memory(config: ServeConfig, host_kv_bytes: int) -> tuple[int, str]:
    """The bound on the recall tier's cold stores' host memory, and in plain words where it came from:
    --recall-memory, else half the host memory free beside the rows (``host_kv_bytes``: the rows' KV where it
    is host memory, on a CPU) at most DEFAULT_RECALL_MEMORY. The stores grow by pages as conversations get long
    and, at the bound, further evicted tokens are dropped (``recall.cold_bound``)."""
    if config.recall_memory is not None:
        return config.recall_memory, f"--recall-memory {format_bytes(config.recall_memory)}"
    share = max(1, int(AUTO_MEMORY_SHARE * max(available_memory("cpu") - host_kv_bytes, 0)))
    if share >= DEFAULT_RECALL_MEMORY:
        return DEFAULT_RECALL_MEMORY, f"the default {format_bytes(DEFAULT_RECALL_MEMORY)}; --recall-memory for more"
    return share, f"half the host memory free beside the rows, {format_bytes(share)}"


def cold_row_bytes(backend: ModelBackend, positions: int) -> int:
    """Host bytes a recall tier's cold store takes for one row holding the model's context window of
    tokens (every token past the row's slots evicted; 0 without a tier that keeps them): what the start-up
    line says a long conversation's store grows to (it grows by pages, from nothing; a conversation longer
    than that costs more, within --recall-memory)."""
    return int(backend.cache.tier_host_bytes_per_token() * max(positions - backend.slots, 0))


def _no_row(source: str, row_bytes: int) -> str:
    return (f"{source} holds no sequence row: one row of this cache takes {format_bytes(row_bytes)} "
            "(give more --kv-memory, a smaller --budget, or --max-sequences)")


def row_bytes_before_loading(config: ServeConfig) -> int | None:
    """One row's bytes, from the model's configuration alone (the model built on the meta device:
    no weights read, nothing allocated), so a --kv-memory too small is refused before the model
    loads; None where the configuration is not at hand without loading (a hub model, a GGUF file)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..engine import attention
    from ..loading.models import pick_device, pick_dtype

    model_config = _config_before_loading(config)
    if model_config is None:
        return None
    attention.register()
    dtype = pick_dtype(config.dtype, pick_device(config.device))
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config, attn_implementation=attention.NAME, dtype=dtype)
        return ModelBackend(model, config.settings, 1, store=ParkedStore(0),
                            prefill_chunk=config.prefill_chunk).row_bytes()
    except Exception:  # noqa: BLE001  a model the meta device cannot build: choose_rows checks once it is loaded
        return None


def _config_before_loading(config: ServeConfig):
    from transformers import AutoConfig

    if config.random_weights:
        return random_source(config.model)[1]
    if shipped_config_path(config.model) is not None:
        return shipped_config(config.model)
    folder = Path(config.model).expanduser()
    if (folder / "config.json").is_file():
        try:
            return AutoConfig.from_pretrained(str(folder))
        except (OSError, ValueError, KeyError):
            return None  # loading the model says what is wrong with it
    return None


def check_kv_memory(config: ServeConfig) -> None:
    """Refuse a --kv-memory that holds no row before the model loads (where its configuration says
    how big a row is, its device KV: what choose_rows counts; otherwise choose_rows refuses it once the
    model is loaded)."""
    if config.max_sequences or not config.kv_memory:
        return
    row_bytes = row_bytes_before_loading(config)
    if row_bytes is not None and config.kv_memory < row_bytes:
        raise UserError(_no_row(f"--kv-memory {format_bytes(config.kv_memory)}", row_bytes))


def loader(config: ServeConfig, store: ParkedStore, compute_threads: int):
    """The engine's load function for ``config``; it sets the engine thread's ``compute_threads`` first."""

    def load_engine() -> Loaded:
        threads.use(compute_threads)
        settings = config.settings
        loaded = load(config.model, config.device, config.dtype, random_weights=config.random_weights,
                      kv_slots=settings.kv_slots_needed(config.prefill_chunk), kv_batch=config.max_sequences or 1)
        probe = ModelBackend(loaded.model, settings, 1, store=store, prefill_chunk=config.prefill_chunk)
        row_bytes = probe.row_bytes()
        positions = max_positions(loaded.model.config)
        cold_bytes = cold_row_bytes(probe, positions)
        keeps_evicted = bool(probe.cache.tier_host_bytes_per_token())  # (a recall tier: its cold stores are bounded)
        del probe
        rows, source = choose_rows(config, row_bytes, loaded.device)
        host_kv = rows * row_bytes if loaded.device.type == "cpu" else 0
        cold_bound, cold_source = choose_recall_memory(config, host_kv) if keeps_evicted else (None, "")
        pack_linears(loaded.model, rows)  # (loaded for max_sequences or one row: the form for the rows chosen)
        backend = ModelBackend(loaded.model, settings, rows, store=store, prefill_chunk=config.prefill_chunk,
                               compile=config.compile, compile_backend=config.compile_backend,
                               mixed_steps=config.mixed_steps,
                               cold_bound=ColdBound(cold_bound) if cold_bound is not None else None)
        if backend.compiled:  # compile now, while /health says loading, not in the first request
            log.info("compiling the decode step for %d rows (%s): minutes on a CPU the first time, less once the "
                     "compile cache in %s holds its graphs (--no-compile starts in seconds, decoding slower)…",
                     rows, backend.decode_step.shapes, persistent_compile_cache())
            failed = backend.compiled_warm_up()
            if failed:
                log.warning("compiling the decode step failed, decoding eagerly: %s", failed)
        model_config = loaded.model.config
        policy = settings.resolved_policy()
        bounded = settings.positions == "absolute" or policy.grows or backend.slots >= positions
        # the full cache holds a conversation of its slots at most; the others of the model's positions
        context = min(positions, backend.slots) if policy.grows else positions
        preparer = Preparer(loaded.tokenizer, store, vocab_size=model_config.vocab_size, max_context=context,
                            bounded=bounded, max_tokens_cap=config.max_tokens,
                            repetition_penalty=config.repetition_penalty, repeat_last_n=config.repeat_last_n,
                            max_prompt_tokens=config.max_prompt_tokens)
        log.info("%s loaded on %s: %d conversations at once (%s)", loaded.name, loaded.device, rows, source)
        log.info("memory beyond the model: %s for the rows' KV slots, %sup to %s for finished conversations kept "
                 "for their next turn (--parked-bytes)%s", format_bytes(rows * row_bytes),
                 recall_memory_line(cold_bound, cold_source), format_bytes(store.capacity),
                 prompt_bound(backend, config, positions))
        log.info("%s cache of %d slots per row at %s, %s; %s decode step, prompt chunks %s, %s linears",
                 policy.name, backend.slots, slot_format(settings, loaded.model),
                 recall_line(backend, cold_bytes, positions), "compiled" if backend.compiled else "eager",
                 "in the decode steps" if backend.mixes_steps else "apart", form_of(loaded.model))
        return Loaded(backend, loaded.tokenizer, preparer, frozenset(stop_token_ids(loaded.tokenizer, loaded.model)),
                      config.served_name or config.model, row_bytes=row_bytes,
                      layers=model_config.num_hidden_layers, kv_heads=backend.kv_heads,
                      prefill_chunks=config.prefill_chunks_per_step)

    return load_engine


def prompt_bound(backend: ModelBackend, config: ServeConfig, positions: int) -> str:
    """What one row's recall store can grow to: it keeps every token its conversation evicted, so a
    conversation longer than the model's window (the rows are sized by) costs more; a request's prompt
    is bounded by --max-prompt-tokens and its reply by --max-tokens."""
    per_token = backend.cache.tier_host_bytes_per_token()
    if not per_token:
        return ""
    if not config.max_prompt_tokens:
        return "; a row's recall store grows with its conversation, with no bound (--max-prompt-tokens 0)"
    longest = config.max_prompt_tokens + config.max_tokens
    grown = int(per_token * max(longest - backend.slots, 0))
    return (f"; a row's recall store grows with its conversation: {format_bytes(grown)} at most for one request "
            f"({config.max_prompt_tokens:,} prompt tokens, --max-prompt-tokens, and {config.max_tokens:,} generated)")


def recall_memory_line(bound: int | None, source: str) -> str:
    """What the start-up line says of the cold stores' bound (nothing without recall)."""
    if bound is None:
        return ""
    return (f"up to {format_bytes(bound)} for the recall tier's cold stores ({source}; they grow by pages as "
            "conversations get long, and at the bound further evicted tokens are dropped, as without recall), ")


def slot_format(settings: CacheSettings, model) -> str:
    """The slots' format for the start-up line: --kv-dtype, auto named by the model's dtype."""
    if settings.kv_dtype != "auto":
        return settings.kv_dtype
    return f"auto ({str(next(model.parameters()).dtype).replace('torch.', '')})"


def recall_line(backend: ModelBackend, cold_bytes: int, positions: int) -> str:
    """What the start-up line says of recall: its slots and page, or that it is off."""
    record = backend.cache.tier_record()
    if not record:
        return "no recall (evicted tokens are dropped)"
    return (f"recall {record['recall_slots']} of them (pages of {record['page']}, {record['selector']} selector, "
            f"a cold store growing by pages to {cold_bytes / 2**20:.0f} MiB of host memory for a row at {positions} "
            "tokens)")


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound and listening on ``host:port``, or a UserError that names the cause: bound
    before anything is said to be listening and before the model loads, so a bad address costs
    nothing and is reported as what it is."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on {host}:{port}: --host {host!r} is not an address of this machine "
                        f"or a name it can resolve ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may reuse the port
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = BIND_HINTS.get(exc.errno, "")
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sock


BIND_HINTS = {
    errno.EADDRINUSE: " (another process listens there: stop it or pick another --port)",
    errno.EACCES: " (ports below 1024 need privileges: pick a --port above 1023)",
    errno.EADDRNOTAVAIL: " (no interface of this machine has that --host address)",
}


class _Server(uvicorn.Server):
    """uvicorn, stopped by SIGINT or SIGTERM the way a client can follow: first the engine fails
    every request it holds (a stream ends with an error event and [DONE], a whole response is a 503),
    then uvicorn waits for those responses to close. (uvicorn alone waits for the streams to finish,
    then cancels them mid-event after its timeout.) The signal is not raised again afterwards: the
    command exits 130 for SIGINT, 0 for SIGTERM."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine
        self.stopped_by: int | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: do not wait for the responses
        self.stopped_by = self.stopped_by or sig
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self.stopped_by is not None:
            log.info("%s: stopping%s", signal.Signals(self.stopped_by).name,
                     " (the requests running end with an error)" if self.engine.ready else "")
        self.engine.stop(timeout=0)
        await super().shutdown(sockets)


def serve(config: ServeConfig) -> int:
    """Listen on ``config.host:config.port`` until SIGINT or SIGTERM (the model loads in the
    background); the exit status. A bad address or KV memory raises a UserError before loading."""
    with threads.handed_over() as compute_threads:  # (only the engine's thread computes, with all of them)
        return _serve(config, compute_threads)


def _serve(config: ServeConfig, compute_threads: int) -> int:
    logging.basicConfig(level=logging.INFO, format="h2ochat serve: %(message)s", stream=sys.stderr)
    logging.getLogger("h2ochat.serve.requests").setLevel(logging.WARNING if config.quiet else logging.INFO)
    threads.in_passing_thread(check_kv_memory, config)
    sock = listen_socket(config.host, config.port)
    store = ParkedStore(config.parked_bytes)
    engine = Engine(loader(config, store, compute_threads), store=store, metrics=Metrics(), max_queue=config.max_queue)
    app = build_app(engine, api_key=config.api_key)
    server = _Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S),
                     engine)

    def stop_if_loading_failed():
        engine.load_finished.wait()
        if engine.load_exception is not None:
            server.should_exit = True

    host, port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d (GET /health says 503 until the model is loaded)",
             f"[{host}]" if ":" in host else host, port)
    interrupted = False
    try:
        engine.start()
        threading.Thread(target=stop_if_loading_failed, daemon=True).start()
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # before uvicorn took the signals over
        interrupted = True
    finally:
        sock.close()
    status = EXIT_INTERRUPTED if interrupted or server.stopped_by == signal.SIGINT else 0
    _end_engine(engine, status)
    if engine.load_exception is not None:
        raise engine.load_exception  # the command turns a user's mistake into one line
    return status


def _end_engine(engine: Engine, status: int) -> None:
    """Wait for the engine thread to end its step; one still loading the model cannot be stopped,
    and an interpreter that exits around it aborts in torch's C++ teardown ("terminate called
    without an active exception"), so the process ends at once instead, its output flushed."""
    try:
        ended = engine.load_finished.is_set() and engine.stop(timeout=ENGINE_STOP_S)
    except KeyboardInterrupt:  # Ctrl-C again while the step ends
        ended, status = False, EXIT_INTERRUPTED
    if not ended:
        log.info("stopped while the model was loading" if not engine.load_finished.is_set() else
                 "stopped without waiting for the engine's step to end")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
