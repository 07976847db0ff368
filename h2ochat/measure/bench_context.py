"""The caches a benchmark measures, each one as if it had seen N tokens, and the decode step run on them.

A context of N tokens is built without an N-token prefill: one real token initialises every
layer's cache, then ``H2OCache.assume_seen`` fills the slots with random keys and values and sets
the counters as if N tokens had been fed. A decode step costs the same whatever the values it reads, and this keeps
the benchmark to minutes (a real 4096-token prefill at batch 32 takes longer than the whole run).

Shared by the timing (bench_measure.py) and the operation counts (bench_ops.py), so both measure
the same cache and the same step.
"""

from __future__ import annotations

from typing import Callable

import torch

from .bench_baseline import SlotsOnlyCache
from ..engine.compiled import CompiledDecode
from ..engine.forward_step import forward
from ..engine.generation import max_positions
from ..kv import H2OCache
from ..cache_factory import make_cache
from ..recall.synthetic import fill_cold_tier
from ..rotary import find_rotary


VARIANTS = ("h2o", "slots", "full", "hf")
RECALL = "recall"  # the variant BenchPlan.recall adds: h2o's policy and device slots, two tiers
COMPILABLE_VARIANTS = ("h2o", "slots")  # the others grow (full) or are not ours (hf)
SAME_BYTES = "@bytes"


def quantized_variants(kv_dtype: str) -> tuple[str, str]:
    """The variants BenchPlan.kv_dtypes adds for one --kv-dtype: h2o with its slots in that dtype at
    h2o's slots (``h2o[int8]``) and at h2o's bytes (``h2o[int8]@bytes``: as many slots as fit in the
    bytes of h2o's slots at the model's dtype)."""
    return f"h2o[{kv_dtype}]", f"h2o[{kv_dtype}]{SAME_BYTES}"


def variant_kv_dtype(variant: str) -> tuple[str, str, bool]:
    """(the variant it is built as, its --kv-dtype, whether at the same bytes) of a variant name."""
    if not variant.startswith("h2o["):
        return variant, "auto", False
    kv_dtype, _, rest = variant[len("h2o["):].partition("]")
    return "h2o", kv_dtype, rest == SAME_BYTES


def compilable(variant: str) -> bool:
    return variant_kv_dtype(variant)[0] in (*COMPILABLE_VARIANTS, RECALL)


def same_bytes_slots(model, slots: int, kv_dtype: str) -> int:
    """The slots of ``kv_dtype`` whose bytes are those of ``slots`` at the model's dtype."""
    from ..engine.generation import CacheSettings

    plain, other = (CacheSettings(kv_dtype=name).slot_bytes(model) for name in ("auto", kv_dtype))
    return slots * plain // other


def build_cache(model, variant: str, slots: int, context: int, extra: int, policy: str = "h2o",
                static_shapes: bool = False, recall=None) -> H2OCache:
    """A fresh cache of ``variant`` (not hf): ``slots`` for h2o/slots/recall, context + extra for full.
    ``slots`` is the same slots with bookkeeping off (the cache's own timing baseline); ``recall`` the
    same device slots, R of them recall slots (``recall``: the ``CacheSettings`` holding --recall)."""
    config = model.config
    layers, limit, rotary = config.num_hidden_layers, max_positions(config), find_rotary(model)
    variant, kv_dtype, same_bytes = variant_kv_dtype(variant)
    if same_bytes:
        slots = same_bytes_slots(model, slots, kv_dtype)
    common = dict(max_positions=limit, positions="absolute", rotary=rotary, kv_dtype=kv_dtype)
    if variant == "slots":  # the timing baseline: no cache to generate with, its own kind
        return SlotsOnlyCache(layers, policy, slots, static_shapes=static_shapes,
                              **{k: v for k, v in common.items() if k != "kv_dtype"})
    if variant == "full":
        return make_cache(layers, "full", context + extra, **common)
    tier = recall.recall_config(slots) if variant == RECALL else None
    return make_cache(layers, policy, slots, recall=tier, static_shapes=static_shapes, **common)


def _drawn_where_used(generator: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device``, seeded from ``generator``: a synthetic context is drawn where it
    lives (drawing 64 GiB of OPT-6.7B keys at batch 32 on the CPU and copying them would take minutes)."""
    if generator.device == device:
        return generator
    return torch.Generator(device).manual_seed(generator.initial_seed())


def fill_synthetic_dynamic(cache, context: int, generator: torch.Generator) -> None:
    """``H2OCache.assume_seen`` for a transformers ``DynamicCache`` already holding one token per layer:
    ``context`` random keys and values per layer."""
    generator = _drawn_where_used(generator, cache.layers[0].keys.device)
    for layer in cache.layers:
        for name in ("keys", "values"):
            old = getattr(layer, name)
            shape = (*old.shape[:2], context, old.shape[-1])
            setattr(layer, name, torch.randn(shape, generator=generator, device=old.device, dtype=old.dtype))


def prepared_cache(model, variant: str, tokens: torch.Tensor, *, context: int, slots: int, extra: int, policy,
                   generator: torch.Generator, recall=None) -> H2OCache:
    """A cache of ``variant`` that has seen ``context`` tokens (``tokens`` [B, 1] initialises it);
    the recall variant's cold tier holds every token its hot slots do not."""
    cache = build_cache(model, variant, slots, context, extra, policy, recall=recall)
    forward(model, cache, tokens, logits_to_keep=1)  # allocates every layer's slots
    drawn = _drawn_where_used(generator, cache.layers[0].keys.device)
    cache.assume_seen(context, drawn)
    if variant == RECALL:
        fill_cold_tier(cache, context, drawn)
    return cache


def decode_step(model, cache: H2OCache, compile: bool = False) -> tuple[Callable[[torch.Tensor], object], bool]:
    """A function feeding one token per row [B, 1] through ``cache``, eager or compiled; and whether
    it is compiled (a cache the compiled step does not cover runs eagerly)."""
    if compile:
        decoder = CompiledDecode(model)
        if decoder.prepare(cache):
            return (lambda ids: decoder(cache, ids)), True
    return (lambda ids: forward(model, cache, ids, logits_to_keep=1)), False
