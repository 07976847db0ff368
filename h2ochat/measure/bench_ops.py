"""Launches: the operations one decode step runs, counted from ``torch.profiler``.

One decode step of h2o and of slots runs under ``torch.profiler`` and the report counts its
top-level operations (an aten op not called from inside another aten op, views included; in a
compiled step also each fused inductor kernel): per layer inside the attention call (eager only:
the registered attention function is wrapped in a profiler range for that step), and for the whole
step divided by the number of layers (embeddings, norms, MLPs and the logits included).
"""

from __future__ import annotations

import collections
import contextlib

import torch

from ..engine.attention import NAME as H2O_ATTENTION
from ..engine.attention import h2o_attention
from .bench_context import decode_step, prepared_cache
from .bench_measure import sync

ATTENTION_RANGE = "h2ochat::attention"


@contextlib.contextmanager
def attention_ranges():
    """The registered h2o attention, wrapped in a profiler range (for an eager step: a compiled step
    traced the plain function, and swapping it would recompile)."""
    from transformers import AttentionInterface

    def ranged(*args, **kwargs):
        with torch.profiler.record_function(ATTENTION_RANGE):
            return h2o_attention(*args, **kwargs)

    AttentionInterface.register(H2O_ATTENTION, ranged)
    try:
        yield
    finally:
        AttentionInterface.register(H2O_ATTENTION, h2o_attention)


def _is_kernel(name: str) -> bool:
    return name.startswith("aten::") or "cpp_fused" in name or name.startswith("triton_")


def count_ops(events, layers: int) -> dict:
    """Top-level operations in profiler ``events`` of one decode step: aten ops not called from
    inside another aten op (views included), plus fused inductor kernels (cpp_fused_*/triton_*)."""
    total, in_attention, ranges = 0, 0, 0
    names: collections.Counter = collections.Counter()
    for event in events:
        if event.name == ATTENTION_RANGE:
            ranges += 1
        if not _is_kernel(event.name):
            continue
        parent, nested, attention = event.cpu_parent, False, False
        while parent is not None:
            if _is_kernel(parent.name):
                nested = True
                break
            attention |= parent.name == ATTENTION_RANGE
            parent = parent.cpu_parent
        if nested:
            continue
        total += 1
        names[event.name] += 1
        in_attention += attention
    return {
        "step_ops": total,
        "step_ops_per_layer": round(total / layers, 1),
        "attention_ops_per_layer": round(in_attention / ranges, 1) if ranges else None,
        "most_common": dict(names.most_common(8)),
    }


def profile_ops(model, variant: str, *, context: int, batch: int, slots: int, policy="h2o", compile: bool = False,
                seed: int = 0, recall=None) -> dict:
    """Operations of one decode step of ``variant`` (h2o, slots or recall), counted from torch.profiler."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (3, batch, 1), generator=generator).to(device)
    cache = prepared_cache(model, variant, tokens[0], context=context, slots=slots, extra=2, policy=policy,
                           generator=generator, recall=recall)
    step, compiled = decode_step(model, cache, compile)
    step(tokens[1])  # compiles, or warms up
    sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with attention_ranges() if not compiled else contextlib.nullcontext():
        with torch.profiler.profile(activities=activities) as profile:
            step(tokens[2])
            sync(device)
    layers = model.config.num_hidden_layers
    counted = count_ops(profile.events(), layers)
    if device.type == "cuda":
        kernels = sum(1 for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        counted["device_kernels_per_layer"] = round(kernels / layers, 1)
    return {"policy": variant, "compiled": compiled, "layers": layers, **counted}
