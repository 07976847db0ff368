"""Loading a model: ``load`` builds it with the ``h2o`` attention implementation and its tokenizer,
from the hub, a local directory, a GGUF file, or (``random_weights=True``) a shipped configuration
with random weights, after refusing one that will not fit (weights, plus the KV cache when the
caller says how many slots and sequences it will hold) before a byte of it is loaded.

What it builds on lives beside it, one concern a module: ``sources`` (aliases, ``resolve``,
shipped configurations), ``hub`` (metadata and download), ``gguf_conversion`` (the de-quantized copy
kept for next time), ``memory`` (sizes and the memory check), ``random_weights``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .gguf_conversion import converted_gguf_dir, keep_converted, quiet_gguf_advice, remove_stale_partials
from .hub import download, hub_info, hub_parameter_count
from .memory import check_memory, config_parameters, parameter_count
from .sources import ModelError, ModelSource, missing_parts, resolve, shipped_config
from .random_weights import ByteTokenizer, build_random, random_source

# deliberate re-exports: serve/server.py (another session's files, not touched by this split) still reads
# these two from here; they live in memory and sources
from .memory import available_memory  # noqa: F401
from .sources import shipped_config_path  # noqa: F401

# torch, transformers and the h2o attention (which imports transformers) are imported where they are
# used: `h2ochat --help` and option checks read this module, and those imports take seconds

# GGUF architectures transformers can load that are attention-compatible with the h2o path
SUPPORTED_GGUF_ARCHITECTURES = {"llama", "mistral", "qwen2"}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: ModelSource
    params: int | None
    device: torch.device
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def weight_bytes(self) -> int:
        from ..engine.packed_linears import weight_bytes

        return weight_bytes(self.model)


def pick_device(device: str) -> str:
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise ModelError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda asked for, but torch sees no CUDA device")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    import torch

    choices = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype == "auto":
        if device == "cpu":  # bf16 only where the CPU multiplies it natively (docs/results.md: dtype)
            from .native_bf16 import cpu_has_native_bf16

            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in choices:
        raise ModelError(f"--dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
    return choices[dtype]


# slots per layer and KV head, or a function of the model configuration returning them
KVSlots = int | Callable[[object], int] | None


def _slots_for(kv_slots, config) -> int | None:
    """``kv_slots`` as a number: a callable gets the model's configuration (a budget that is a
    fraction of the context window needs it)."""
    if kv_slots is None or config is None:
        return None
    return int(kv_slots(config)) if callable(kv_slots) else int(kv_slots)


def _local_config(source: ModelSource, folder: Path):
    """The configuration of a downloaded snapshot, directory or GGUF file, read for the KV memory
    check; None when unreadable (loading the model reports why)."""
    from transformers import AutoConfig

    try:
        if source.kind == "gguf":
            return AutoConfig.from_pretrained(str(folder.parent), gguf_file=folder.name)
        return AutoConfig.from_pretrained(str(folder))
    except Exception:
        return None


def _load_random(name: str, device: str, dtype: torch.dtype, device_map: str | None, kv_slots: KVSlots,
                 kv_batch: int, check_config: Callable[[object], None] | None = None,
                 decode_rows: int | None = None) -> LoadedModel:
    import torch

    if device_map:
        raise ModelError("--random-weights builds the model on one device: drop --device-map")
    source, config = random_source(name)
    if check_config is not None:
        check_config(config)
    params = config_parameters(config)
    check_memory(params, dtype, device, source.name, config=config, kv_slots=_slots_for(kv_slots, config),
                 kv_batch=kv_batch)
    from ..engine.packed_linears import pack_linears

    model = build_random(config, dtype, device)
    pack_linears(model, decode_rows or kv_batch)
    if model.generation_config is not None:  # the real vocabulary's end token is a plain byte here
        model.generation_config.eos_token_id = None
    return LoadedModel(model, ByteTokenizer(config.vocab_size), source, params, torch.device(device), dtype)


def one_paragraph(message: str, limit: int = 400) -> str:
    """A library's message on one line: its lines joined (transformers' "...from one of:" is followed
    by what it tried), cut at ``limit`` characters."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def load(name: str, device: str = "auto", dtype: str = "auto", device_map: str | None = None, *,
         random_weights: bool = False, kv_slots: KVSlots = None, kv_batch: int = 1,
         check_config: Callable[[object], None] | None = None, decode_rows: int | None = None) -> LoadedModel:
    """Load ``name`` with the h2o attention implementation, ready for an ``H2OCache``.

    ``random_weights``: build it from its shipped configuration (or a directory's config.json) with
    random weights and a byte-level tokenizer, no download. ``kv_slots`` (slots per layer and KV head,
    or a function of the model's configuration returning them) and ``kv_batch`` (sequences) add the
    KV cache the caller will allocate to the memory check made before loading. ``check_config`` is
    called with the model's configuration as soon as it is read (before the memory check and the
    weights: a budget past the context window is refused in a second, not after the load).
    ``decode_rows`` (default ``kv_batch``): the most rows a decode step multiplies, which chooses the
    linears' form (``engine.packed_linears.pack_linears``; a caller that learns it later packs again)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..engine import attention
    from ..engine.packed_linears import pack_linears

    attention.register()
    if random_weights:
        device = pick_device(device)
        return _load_random(name, device, pick_dtype(dtype, device), device_map, kv_slots, kv_batch, check_config,
                            decode_rows)
    source = resolve(name)
    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    memory_device = "auto" if device_map else device
    if source.kind == "gguf" and source.family not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelError(f"GGUF architecture {source.family!r} is not supported "
                         f"(supported: {', '.join(sorted(SUPPORTED_GGUF_ARCHITECTURES))})")
    if source.kind == "hub":
        info = hub_info(source.location)
        params = hub_parameter_count(source.location, info)
        shipped = shipped_config(source.name) if kv_slots is not None or check_config or params is None else None
        if params is None and shipped is not None:  # the hub reports no count for *.bin-only repositories
            params = config_parameters(shipped)
        if shipped is not None and check_config is not None:  # before the download
            check_config(shipped)
        check_memory(params, torch_dtype, memory_device, source.name, config=shipped,
                     kv_slots=_slots_for(kv_slots, shipped), kv_batch=kv_batch)
        folder = download(source.location, info)
    else:
        folder = Path(source.location)
    # where a GGUF file's converted copy is kept (its key hashes two MiB of the file: found once); a copy made
    # before says in its headers and config.json what parsing the file would (seconds)
    converted = converted_gguf_dir(folder, torch_dtype) if source.kind == "gguf" else None
    ready = converted if converted is not None and (converted / "config.json").is_file() else None
    read_from = ModelSource(source.name, "dir", str(ready), source.family) if ready is not None else source
    params = parameter_count(read_from, ready or folder)
    wants_config = kv_slots is not None or check_config is not None
    config = _local_config(read_from, ready or folder) if wants_config else None
    if config is not None and check_config is not None:
        check_config(config)
    check_memory(params, torch_dtype, memory_device, source.name, config=config,
                 kv_slots=_slots_for(kv_slots, config), kv_batch=kv_batch)
    if source.kind == "dir" and (missing := missing_parts(folder)):
        raise ModelError(f"{source.name} holds a config.json but no {' and no '.join(missing)}: it cannot be "
                         "loaded (--random-weights builds the configuration with random weights)")

    kwargs = {"dtype": torch_dtype, "attn_implementation": attention.NAME}
    tokenizer_kwargs = {}
    if source.kind == "gguf":
        remove_stale_partials(converted.parent)  # a killed conversion's hundreds of MB
        if ready is not None:
            folder, converted = ready, None
        else:
            tokenizer_kwargs = {"gguf_file": folder.name}
            kwargs["gguf_file"] = folder.name
            folder = folder.parent
    if device_map:
        kwargs["device_map"] = device_map
    try:
        with quiet_gguf_advice():
            tokenizer = AutoTokenizer.from_pretrained(str(folder), **tokenizer_kwargs)
            model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"could not load {source.name}: {one_paragraph(str(exc))}") from None
    if converted is not None:
        failed = keep_converted(model, tokenizer, converted)
        if failed:  # (once a run: the next run finds no copy and says it again, the cost being paid again)
            print(f"h2ochat: warning: {failed}", file=sys.stderr)
    if not device_map:
        model.to(device)
    model.eval()
    if not device_map:  # (one device: a model spread over several keeps transformers' linears)
        pack_linears(model, decode_rows or kv_batch)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model, tokenizer, source, params, torch.device(device if not device_map else model.device), torch_dtype)
