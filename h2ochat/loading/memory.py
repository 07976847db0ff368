"""How big a model is and whether it fits: parameters read from weight headers (GGUF, safetensors)
or counted from a configuration on the meta device, the KV cache's bytes, and ``check_memory``, which
refuses in one line a model that would not fit before a byte of it is loaded.

Its own module because the serve command sizes its rows with the same figures, without loading.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

from .sources import ALIASES, ModelError, ModelSource


def _gguf_parameters(path: Path) -> int:
    from gguf import GGUFReader

    return int(sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors))


def _safetensors_parameters(path: Path) -> int:
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    total = 0
    for key, info in header.items():
        if key != "__metadata__":
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
    return total


def parameter_count(source: ModelSource, local_dir: Path | None = None) -> int | None:
    """Parameters of the model, read from weight headers (None when they cannot be read)."""
    if source.kind == "gguf":
        return _gguf_parameters(Path(source.location))
    folder = Path(local_dir or source.location)
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        return sum(_safetensors_parameters(p) for p in shards)
    bins = sorted(folder.glob("*.bin"))
    if bins:  # pickled weights: assume 2 bytes a parameter, as published checkpoints mostly are
        return sum(p.stat().st_size for p in bins) // 2
    alias = next((a for a in ALIASES.values() if a.repo == source.location), None)
    return int(alias.params_b * 1e9) if alias else None


def config_parameters(config) -> int:
    """Parameters of the model ``config`` describes, counted on the meta device (nothing allocated;
    tied embeddings counted once)."""
    from transformers import AutoModelForCausalLM
    import torch

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))  # from_config writes onto the config
    return sum(p.numel() for p in model.parameters())


def available_memory(device: str) -> int:
    """Bytes free for weights on ``device`` ("cpu", "cuda", or "auto" for device_map=auto)."""
    import torch

    from ..host_memory import free_host_bytes

    cpu = free_host_bytes()
    if device == "cpu" or not torch.cuda.is_available():
        return cpu
    gpus = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    return gpus + cpu if device == "auto" else torch.cuda.mem_get_info()[0]


def kv_bytes(config, slots: int, batch: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values in a cache of ``slots`` per layer and KV head for ``batch`` sequences:
    layers x KV heads x head_dim x slots x batch x 2 (K and V) x bytes per element, what
    ``H2OCache.kv_bytes()`` reports once allocated (its per-slot score and indices come on top:
    20 bytes against 512 for K and V at head_dim 128 in fp16)."""
    import torch

    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * heads * head_dim * 2 * slots * batch * (torch.finfo(dtype).bits // 8)


def check_memory(params: int | None, dtype: torch.dtype, device: str, name: str, *, config=None,
                 kv_slots: int | None = None, kv_batch: int = 1) -> None:
    """Refuse in one line a model whose weights (``params``, None = unknown) plus, when ``config`` and
    ``kv_slots`` are given, the KV cache of ``kv_slots`` slots for ``kv_batch`` sequences would not fit
    in 90% of the memory free on ``device``."""
    import torch

    per_param = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1
    weights = (params or 0) * per_param
    kv = kv_bytes(config, kv_slots, kv_batch, dtype) if config is not None and kv_slots else 0
    if params is None and not kv:
        return
    free = available_memory(device)
    if weights + kv <= 0.9 * free:
        return
    parts = [f"about {weights / 2**30:.1f} GiB for its weights in {str(dtype).removeprefix('torch.')}"] if params else []
    if kv:
        parts.append(f"{kv / 2**30:.1f} GiB for its KV cache ({kv_slots} slots x batch {kv_batch})")
    hint = "a smaller --budget or batch, " if kv else ""
    raise ModelError(f"{name} needs {' + '.join(parts)} but only {free / 2**30:.1f} GiB is free on {device}; "
                     f"try {hint}a smaller model or --dtype float16")
