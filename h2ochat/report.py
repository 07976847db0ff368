"""Numbers about a run: memory, speed and the cache, as one JSON-ready record."""

from __future__ import annotations

import resource
import sys

import torch

from .cache import H2OCache
from .generation import Timing


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak CUDA memory allocated on a GPU, peak resident set size of the process otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def cache_record(cache: H2OCache) -> dict:
    budget = cache.budget
    return {
        "policy": cache.policy.name,
        "kv_slots": cache.layers[0].capacity,
        "heavy_slots": budget.heavy,
        "recent_slots": budget.recent,
        "sink_slots": budget.sinks,
        "positions": cache.position_mode,
        "position_renumberings": cache.compactions,
        "kv_bytes": cache.kv_bytes(),
        "bookkeeping_bytes": cache.bookkeeping_bytes(),
        "full_kv_bytes": cache.full_kv_bytes(),
        "evicted_tokens": cache.evicted_tokens(),
        "evicted_tokens_counted": "per layer and KV head, summed over layers, heads and sequences",
    }


def run_record(loaded, cache: H2OCache, timing: Timing, budget: str, text: str) -> dict:
    return {
        "text": text,
        "model": loaded.name,
        "budget": budget,
        **cache_record(cache),
        "prompt_tokens": timing.prompt_tokens,
        "generated_tokens": timing.generated_tokens,
        "prefill_tokens_per_s": round(timing.prefill_tokens_per_s, 2),
        "decode_tokens_per_s": round(timing.decode_tokens_per_s, 2),
        "peak_memory_bytes": peak_memory_bytes(loaded.device),
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
    }
