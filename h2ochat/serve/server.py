"""Wiring: the engine's load function (model, rows, backend) and uvicorn around the application."""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass

from ..chat import stop_token_ids
from ..errors import UserError
from ..generation import CacheSettings, max_positions
from ..models import available_memory, load
from .app import build_app
from .backend import ModelBackend
from .engine import Engine, Loaded
from .metrics import Metrics
from .parked import ParkedStore
from .prepare import Preparer

log = logging.getLogger("h2ochat.serve")

AUTO_MEMORY_SHARE = 0.5  # of the memory free after loading, for the batch rows when --max-sequences is not given
AUTO_MAX_ROWS = 64


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
    parked_bytes: int = 1 << 30
    max_queue: int = 64
    max_tokens: int = 4096
    prefill_chunk: int = 512
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    compile: bool = False
    compile_backend: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None


def choose_rows(config: ServeConfig, row_bytes: int, device) -> tuple[int, str]:
    """N, and where it came from (the start-up log says which)."""
    if config.max_sequences:
        return config.max_sequences, "--max-sequences"
    if config.kv_memory:
        budget, source = config.kv_memory, f"--kv-memory {config.kv_memory / 2**20:.0f} MiB"
    else:
        budget = int(AUTO_MEMORY_SHARE * available_memory(str(device)))
        source = f"half the free memory, {budget / 2**20:.0f} MiB"
    rows = max(1, min(budget // row_bytes, AUTO_MAX_ROWS))
    return rows, f"{source} / {row_bytes / 2**20:.2f} MiB per row" + (f", at most {AUTO_MAX_ROWS}" if
                                                                       budget // row_bytes > AUTO_MAX_ROWS else "")


def loader(config: ServeConfig, store: ParkedStore):
    """The engine's load function for ``config``."""

    def load_engine() -> Loaded:
        settings = config.settings
        loaded = load(config.model, config.device, config.dtype, random_weights=config.random_weights,
                      kv_slots=settings.kv_slots_needed(config.prefill_chunk), kv_batch=config.max_sequences or 1)
        probe = ModelBackend(loaded.model, settings, 1, store=store, prefill_chunk=config.prefill_chunk)
        row_bytes = probe.row_bytes()
        del probe
        rows, source = choose_rows(config, row_bytes, loaded.device)
        backend = ModelBackend(loaded.model, settings, rows, store=store, prefill_chunk=config.prefill_chunk,
                               compile=config.compile, compile_backend=config.compile_backend)
        if config.compile:  # compile now, while /health says loading, not in the first request
            log.info("compiling the decode step for %d rows…", rows)
            backend.warm_up()
        model_config = loaded.model.config
        positions = max_positions(model_config)
        policy = settings.resolved_policy()
        bounded = settings.positions == "absolute" or policy.grows or backend.slots >= positions
        # the full cache holds a conversation of its slots at most; the others of the model's positions
        context = min(positions, backend.slots) if policy.grows else positions
        preparer = Preparer(loaded.tokenizer, store, vocab_size=model_config.vocab_size, max_context=context,
                            bounded=bounded, max_tokens_cap=config.max_tokens,
                            repetition_penalty=config.repetition_penalty, repeat_last_n=config.repeat_last_n)
        log.info("%s loaded on %s: %s cache of %d slots per row; %d sequence rows (from %s), %.1f MiB of KV in all; "
                 "parked conversations up to %.0f MiB", loaded.name, loaded.device, policy.name, backend.slots, rows,
                 source, rows * row_bytes / 2**20, store.capacity / 2**20)
        return Loaded(backend, loaded.tokenizer, preparer, frozenset(stop_token_ids(loaded.tokenizer, loaded.model)),
                      config.served_name or config.model, row_bytes=row_bytes,
                      layers=model_config.num_hidden_layers, kv_heads=backend.kv_heads)

    return load_engine


def serve(config: ServeConfig) -> None:
    """Listen on ``config.host:config.port`` until interrupted; the model loads in the background."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="h2ochat serve: %(message)s", stream=sys.stderr)
    store = ParkedStore(config.parked_bytes)
    engine = Engine(loader(config, store), store=store, metrics=Metrics(), max_queue=config.max_queue)
    app = build_app(engine, api_key=config.api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           timeout_graceful_shutdown=5))

    def stop_if_loading_failed():
        engine.load_finished.wait()
        if engine.load_exception is not None:
            server.should_exit = True

    engine.start()
    threading.Thread(target=stop_if_loading_failed, daemon=True).start()
    log.info("listening on http://%s:%d (GET /health says 503 until the model is loaded)", config.host, config.port)
    try:
        server.run()
    except SystemExit:  # uvicorn's answer to an address it cannot bind: said below in one line
        if server.started:
            raise
    finally:
        engine.stop()
    if engine.load_exception is not None:
        raise engine.load_exception  # the command turns a user's mistake into one line
    if not server.started:
        raise UserError(f"could not listen on {config.host}:{config.port} (is the port in use?)")
