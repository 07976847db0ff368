"""Numbers about a run: memory, speed and the cache, as one JSON-ready record."""

from __future__ import annotations

import resource
import sys

import torch

from ..kv import H2OCache
from .split import evicted_per_head
from ..engine.generation import Timing
from .split import amount, cache_split, kv_memory, layer_splits, split_record


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak CUDA memory allocated on a GPU, peak resident set size of the process otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def cache_record(cache: H2OCache) -> dict:
    # --recall: the cold tier beside the device slots (None without it); its recall slots are device
    # slots of the budget too, beside the policy's hot ones (the split counts them so)
    tier = cache.tier_record() if hasattr(cache, "tier_record") else None
    splits = layer_splits(cache)
    return {
        "policy": cache.policy.name,
        "kv_dtype": cache.kv_dtype,
        **split_record(cache_split(cache, splits), kv_memory(cache, splits)),
        # one slot of every layer, over its KV heads: keys, values (codes) and their scales
        "kv_bytes_per_slot": cache.kv_bytes_per_slot(),
        "positions": cache.position_mode,
        "position_renumberings": cache.compactions,
        "bookkeeping_bytes": cache.bookkeeping_bytes(),
        "evicted_tokens": cache.evicted_tokens(),
        "evicted_tokens_counted": "per layer and KV head, summed over layers, heads and sequences",
        "recall": tier,
    }


def evictions(cache: H2OCache) -> str:
    """Evictions with their unit: each (layer, KV head) of each sequence evicts on its own, so the
    total over them is many times the tokens generated; the mean per (layer, KV head) is the count of
    tokens gone."""
    total = cache.evicted_tokens()
    return (f"{amount(round(evicted_per_head(cache, total), 1))} tokens evicted per layer and KV head ({total} "
            "evictions, summed over layers, KV heads and sequences)")


def evicted_share(cache: H2OCache) -> float | None:
    """The one number for where the budget hurts: the attention share an evicted token held when it
    was dropped, averaged over the layers that evicted (None before the first eviction). Every layer
    evicts once per step, so this is also the mean over all evictions."""
    return mean_evicted_share(cache.layer_stats())


def mean_evicted_share(stats) -> float | None:
    """``evicted_share`` from per-layer statistics already read (``H2OCache.layer_stats()``)."""
    shares = [s.evicted_share for s in stats if s.evicted]
    return sum(shares) / len(shares) if shares else None


def part_shares(cache: H2OCache, parts: list[tuple[str, int, int]], sequence: int = 0) -> list[dict]:
    """For each part (name, first token, end token) of a sequence, the share of its tokens' (layer,
    KV head) slots still held: 1.0 = all still in the cache, 0.0 = all evicted."""
    held = cache.cached_token_share(sequence)
    records = []
    for name, start, end in parts:
        end = min(end, held.numel())  # a last generated token is never fed
        records.append({"name": name, "first_token": start, "tokens": max(end - start, 0),
                        "held_share": round(float(held[start:end].mean()), 4) if end > start else None})
    return records


def cache_stats_record(cache: H2OCache, parts: list[tuple[str, int, int]] | None = None, sequence: int = 0) -> dict:
    """Where the budget hurts, per layer and per part of the text (the /cache figures, as JSON)."""
    layers = []
    for index, (layer, s) in enumerate(zip(cache.layers, cache.layer_stats())):
        heads = layer.evicted.numel() if layer.is_initialized else 1
        layers.append({"layer": index, "capacity": s.capacity, "held": round(s.held, 2), "heavy": round(s.heavy, 2),
                       "recent": round(s.recent, 2), "evicted_per_head": round(s.evicted / heads, 2),
                       "evicted_share": round(s.evicted_share, 6), "heavy_age_median": s.heavy_age_median,
                       "heavy_age_oldest": s.heavy_age_oldest})
    share = evicted_share(cache)
    return {
        "evicted_share": round(share, 6) if share is not None else None,
        "evicted_share_means": "attention share (of its sequence and KV head's score mass) an evicted token held "
                               "when dropped, mean over evictions: near 0 = harmless, high = the layer wants more slots",
        "layers": layers,
        "parts": part_shares(cache, parts or [], sequence),
    }


def run_record(loaded, cache: H2OCache, timing: Timing, budget: str, text: str) -> dict:
    # the generated tokens the cache holds are the text's, less the last (never fed); tokens fed past
    # a stop (stream's read-back bursts) are in the cache's counts but not in the text
    generated_fed = timing.prompt_tokens + max(timing.generated_tokens - 1, 0)
    parts = [("prompt", 0, timing.prompt_tokens), ("generated", timing.prompt_tokens, generated_fed)]
    return {
        "text": text,
        "model": loaded.name,
        "budget": budget,
        **cache_record(cache),
        "cache_stats": cache_stats_record(cache, parts),
        "prompt_tokens": timing.prompt_tokens,
        "generated_tokens": timing.generated_tokens,
        "tokens_fed": cache.longest_row_tokens(),
        "tokens_fed_past_stop": timing.fed_past_stop,
        "prefill_tokens_per_s": round(timing.prefill_tokens_per_s, 2),
        "decode_tokens_per_s": round(timing.decode_tokens_per_s, 2),
        "first_decode_step_s": round(timing.first_step_s, 3) if timing.first_step_s is not None else None,
        "steady_decode_tokens_per_s": round(timing.steady_decode_tokens_per_s, 2),
        "peak_memory_bytes": peak_memory_bytes(loaded.device),
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
    }
