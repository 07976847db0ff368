"""Decode speed and memory of the budgeted cache against a full cache and stock transformers.

Variants, all on the same model weights, at the same batch size and context length:

- ``h2o``: the budgeted ``H2OCache`` (scores, eviction), as generation uses it;
- ``slots``: the same preallocated slots with no scoring and no eviction (``bench_baseline.SlotsOnlyCache``):
  each new token overwrites the oldest slot in place and attention is plain sdpa. h2o against it
  is the price of H2O's bookkeeping;
- ``full``: our cache with the ``full`` policy (same code path as h2o), preallocated to the
  context plus the decode steps, so nothing is evicted and nothing grows while timing;
- ``hf``: stock transformers: the model switched to ``sdpa`` attention with a ``DynamicCache``.

- ``recall`` (with ``BenchPlan.recall``, ``h2ochat bench --recall R``): the same policy through the
  two-tier cache (``kv.make_cache`` with a recall tier) at the same device slots (R of them recall slots), its cold tier filled
  with the context's older tokens (``recall.synthetic.fill_cold_tier``); it takes its turn right
  after h2o, and ``recall_overhead`` compares the two per context and batch against the issue's
  targets (``RECALL_TARGETS``). With ``--recall-every k`` every measurement is timed in blocks of k
  steps (one recall each) and a step's cost is the median block's mean.

With ``BenchPlan.compile`` (``h2ochat bench --compile``), h2o and slots are also timed with the
decode step compiled (``h2ochat.compiled``), taking turns with their eager runs; the compilation
happens in one untimed step before the warm-up and is reported as ``compile_s``.

Launches: one decode step of h2o and of slots runs under ``torch.profiler`` and the report counts
its top-level operations (an aten op not called from inside another aten op, views included; in a
compiled step also each fused inductor kernel): per layer inside the attention call (eager only:
the registered attention function is wrapped in a profiler range for that step), and for the whole
step divided by the number of layers (embeddings, norms, MLPs and the logits included).

A context of N tokens is built without an N-token prefill: one real token initialises every
layer's cache, then ``H2OCache.assume_seen`` fills the slots with random keys and values and sets
the counters as if N tokens had been fed. A decode step costs the same whatever the values it reads, and this keeps
the benchmark to minutes (a real 4096-token prefill at batch 32 takes longer than the whole run).

Memory: KV bytes come from the caches' own allocations. Peak memory is the peak resident set size
during that one measurement on a CPU (the kernel's high-water mark, reset before each one through
/proc/self/clear_refs; weights and everything else the process holds included), or the peak CUDA
memory allocated on a GPU; ``peak_memory_growth_bytes`` is how far it rose during the measurement.
Measurements run one after another in this process (a forked child would be cleaner, but forking
after PyTorch's OpenMP pool has run hangs the child).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from .attention import NAME as H2O_ATTENTION
from .attention import h2o_attention
from .bench_baseline import SlotsOnlyCache
from .kv import H2OCache, make_cache
from .compiled import CompiledDecode
from .forward_step import cache_argument, forward
from .generation import max_positions
from .models import kv_bytes
from .recall.synthetic import fill_cold_tier
from .sizes import parse_size  # noqa: F401  (moved to sizes.py; tests/test_bench.py still reads it here)
from .rotary import find_rotary

VARIANTS = ("h2o", "slots", "full", "hf")
RECALL = "recall"  # the variant BenchPlan.recall adds: h2o's policy and device slots, two tiers
CAPACITY_VARIANTS = ("h2o", "full", "hf")
COMPILABLE_VARIANTS = ("h2o", "slots")  # the others grow (full) or are not ours (hf)


# -- building a cache that has seen N tokens ---------------------------------------------------------

def build_cache(model, variant: str, slots: int, context: int, extra: int, policy: str = "h2o",
                static_shapes: bool = False, recall=None) -> H2OCache:
    """A fresh cache of ``variant`` (not hf): ``slots`` for h2o/slots/recall, context + extra for full.
    ``slots`` is the same slots with bookkeeping off (the cache's own timing baseline); ``recall`` the
    same device slots, R of them recall slots (``recall``: the ``CacheSettings`` holding --recall)."""
    config = model.config
    layers, limit, rotary = config.num_hidden_layers, max_positions(config), find_rotary(model)
    if variant == "full":
        return H2OCache(layers, "full", context + extra, max_positions=limit, positions="absolute", rotary=rotary)
    if variant == RECALL:
        return make_cache(layers, policy, slots, recall=recall.recall_config(slots), max_positions=limit,
                          positions="absolute", rotary=rotary)
    kind = SlotsOnlyCache if variant == "slots" else H2OCache
    return kind(layers, policy, slots, max_positions=limit, positions="absolute", rotary=rotary,
                static_shapes=static_shapes)


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


# -- memory --------------------------------------------------------------------------------------

class PeakMemory:
    """Peak memory of one measurement: CUDA peak allocated, or the process's resident-set
    high-water mark reset before the measurement (Linux); the process-lifetime peak otherwise."""

    def __init__(self, device: torch.device):
        self.device = device
        self.scope = "cuda_allocated" if device.type == "cuda" else "process_rss"
        if device.type != "cuda":
            _return_freed_memory()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # resets VmHWM to the current RSS
        except OSError:
            self.scope = "process_rss_lifetime"
        self.baseline = self._status("VmRSS")

    def peak(self) -> int:
        """Peak bytes since ``reset``, everything the process holds included (weights too)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        peak = self._status("VmHWM")
        if peak is None:
            from .report import peak_memory_bytes

            return peak_memory_bytes(self.device)
        return peak

    def growth(self) -> int | None:
        """How far the peak rose above what was held at ``reset`` (the measurement's own memory)."""
        baseline = getattr(self, "baseline", None)
        return None if baseline is None else max(0, self.peak() - baseline)

    def _status(self, field_name: str) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        try:
            with open("/proc/self/status") as handle:
                return int(re.search(field_name + r":\s+(\d+)", handle.read()).group(1)) * 1024
        except (OSError, AttributeError):
            return None


def _return_freed_memory() -> None:
    """glibc keeps freed blocks below its (moving) mmap threshold in the heap, so RSS would carry
    one measurement's tensors into the next one's peak: a fixed 256 KiB threshold returns them."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


# -- one measurement -------------------------------------------------------------------------------

@dataclass
class Measurement:
    policy: str
    context: int
    batch: int
    kv_slots: int
    kv_bytes: int
    step_ms: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    peak_memory_growth_bytes: int | None = None  # peak above what the process held before
    compiled: bool = False  # the decode step ran compiled (h2ochat.compiled)
    compile_s: float | None = None  # the untimed first compiled step (the compilation, when not cached)
    block: int = 1  # steps timed as one block (--recall-every: one recall per block)
    recall: dict | None = None  # the recall variant's tier (H2OCache.tier_record) and copies per step
    # on a CPU, the process's CPU time per step (all its threads): other jobs' load barely moves it
    step_cpu_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return _blocked_median(self.step_ms, self.block)

    @property
    def cpu_ms(self) -> float | None:
        return _blocked_median(self.step_cpu_ms, self.block) if self.step_cpu_ms else None

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch * 1000.0 / self.median_ms

    def record(self) -> dict:
        out = asdict(self)
        out.pop("step_ms")
        out.pop("step_cpu_ms")
        if self.cpu_ms is not None:
            out["cpu_ms_per_step"] = round(self.cpu_ms, 3)
        if out["recall"] is None:
            out.pop("recall")
        out["ms_per_step"] = round(self.median_ms, 3)
        out["decode_tokens_per_s"] = round(self.decode_tokens_per_s, 2)
        if out["compile_s"] is not None:
            out["compile_s"] = round(out["compile_s"], 2)
        return out


def _blocked_median(step_ms: list[float], block: int) -> float:
    """The median step, or with ``block`` > 1 the median block's mean step: a recall every k steps
    costs each step its share (a plain median would pick a step without one)."""
    if block == 1:
        return statistics.median(step_ms)
    blocks = [step_ms[i:i + block] for i in range(0, len(step_ms) - block + 1, block)]
    return statistics.median(sum(b) / len(b) for b in blocks)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kv_bytes_dynamic(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)


def decode_step(model, cache: H2OCache, compile: bool = False) -> tuple[Callable[[torch.Tensor], object], bool]:
    """A function feeding one token per row [B, 1] through ``cache``, eager or compiled; and whether
    it is compiled (a cache the compiled step does not cover runs eagerly)."""
    if compile:
        decoder = CompiledDecode(model)
        if decoder.prepare(cache):
            return (lambda ids: decoder(cache, ids)), True
    return (lambda ids: forward(model, cache, ids, logits_to_keep=1)), False


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


def _pages_copied(cache: H2OCache) -> int:
    record = cache.tier_record()
    return record["pages_copied"] if record is not None else 0


def measure(model, variant: str, *, context: int, batch: int, slots: int, steps: int, warmup: int,
            memory: PeakMemory, policy="h2o", seed: int = 0, compile: bool = False, recall=None,
            block: int = 1) -> Measurement:
    """Median decode-step latency of ``variant`` at ``batch`` sequences that have seen ``context``
    tokens, with KV bytes and peak memory. ``compile``: h2o and slots run the compiled step, after
    one untimed step that compiles it (or finds it compiled). ``recall``: the settings of the recall
    variant (``CacheSettings`` with --recall). ``block``: steps per timed block (see ``Measurement``)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    first = 2 if compile else 1  # token 0 initialises the cache; token 1 compiles
    tokens = torch.randint(0, vocab, (steps + warmup + first, batch, 1), generator=generator).to(device)
    memory.reset()
    compiled, compile_s = False, None
    if variant == "hf":
        result = _measure_hf(model, tokens[first - 1:], context, generator, warmup)
    else:
        cache = prepared_cache(model, variant, tokens[0], context=context, slots=slots, extra=len(tokens) - 1,
                               policy=policy, generator=generator, recall=recall)
        step, compiled = decode_step(model, cache, compile and variant in (*COMPILABLE_VARIANTS, RECALL))
        if compile:
            started = time.perf_counter()
            step(tokens[1])
            _sync(device)
            compile_s = time.perf_counter() - started if compiled else None
        step_ms, cpu_ms, copied = [], [], _pages_copied(cache)
        for index in range(first, len(tokens)):
            _sync(device)
            started, started_cpu = time.perf_counter(), time.process_time()
            step(tokens[index])
            _sync(device)
            step_ms.append((time.perf_counter() - started) * 1000)
            cpu_ms.append((time.process_time() - started_cpu) * 1000)
        tier = recall_record(cache, _pages_copied(cache) - copied, len(step_ms))
        result = (cache.device_slots(), cache.kv_bytes(), step_ms[warmup:])
        cache.reset()  # its slots go back before the next measurement
    kv_slots, kv_bytes, step_ms = result
    return Measurement(variant, context, batch, kv_slots, kv_bytes, step_ms, memory.peak(), memory.growth(),
                       compiled, compile_s, block, tier if variant == RECALL else None,
                       cpu_ms[warmup:] if variant != "hf" and device.type == "cpu" else [])


def recall_record(cache: H2OCache, copied: int, steps: int) -> dict | None:
    """The two-tier cache's record (``tier_record``: digest device bytes, cold host bytes, ...),
    its --recall-every, and the pages its decode steps copied into the recall slots, per step and
    per (layer, sequence, KV head)."""
    record = cache.tier_record()
    if record is None:
        return None
    layer = cache.layers[0]
    per_step = layer.keys.shape[0] * layer.keys.shape[1] * len(cache.layers) * steps
    return {**record, "pages_copied_per_step": round(copied / per_step, 3)}


# -- launches: operations per decode step ----------------------------------------------------------

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
    _sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with attention_ranges() if not compiled else contextlib.nullcontext():
        with torch.profiler.profile(activities=activities) as profile:
            step(tokens[2])
            _sync(device)
    layers = model.config.num_hidden_layers
    counted = count_ops(profile.events(), layers)
    if device.type == "cuda":
        kernels = sum(1 for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        counted["device_kernels_per_layer"] = round(kernels / layers, 1)
    return {"policy": variant, "compiled": compiled, "layers": layers, **counted}


def _measure_hf(model, tokens, context, generator, warmup):
    from transformers import DynamicCache

    device = tokens.device
    batch = tokens.shape[1]
    model.set_attn_implementation("sdpa")
    try:
        cache = DynamicCache(config=model.config)
        argument = {cache_argument(model): cache}
        with torch.inference_mode():
            model(input_ids=tokens[0], use_cache=True, logits_to_keep=1, **argument)
            fill_synthetic_dynamic(cache, context, generator)
            step_ms = []
            for index in range(1, len(tokens)):
                position = torch.full((batch, 1), context + index - 1, device=device)
                _sync(device)
                started = time.perf_counter()
                model(input_ids=tokens[index], position_ids=position, use_cache=True, logits_to_keep=1, **argument)
                _sync(device)
                step_ms.append((time.perf_counter() - started) * 1000)
        return cache.layers[0].keys.shape[2], _kv_bytes_dynamic(cache), step_ms[warmup:]
    finally:
        model.set_attn_implementation(H2O_ATTENTION)


# -- the whole benchmark ---------------------------------------------------------------------------

def kv_bytes_per_slot(model) -> int:
    """Bytes of keys + values one token takes across all layers and KV heads, for one sequence."""
    return kv_bytes(model.config, slots=1, batch=1, dtype=next(model.parameters()).dtype)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def ideal_speedup(weights: int, per_slot: int, batch: int, context: int, slots: int) -> float:
    """A memory-bound decode step reads the weights and the KV once: the byte ratio."""
    return (weights + per_slot * batch * context) / (weights + per_slot * batch * slots)


COMPILED = " compiled"  # the key suffix of a compiled run among a (context, batch)'s measurements


def comparison(by_variant: dict[str, Measurement], weights: int, per_slot: int) -> dict:
    """Ratios at one (context, batch); ``by_variant`` keys are variant names, + COMPILED for compiled runs."""
    h2o = by_variant["h2o"]

    def ratio(numerator: str, denominator: str):
        top, bottom = by_variant.get(numerator), by_variant.get(denominator)
        if top is None or bottom is None:
            return None
        return round(top.median_ms / bottom.median_ms, 3)

    out = {
        "context": h2o.context,
        "batch": h2o.batch,
        "kv_slots": h2o.kv_slots,
        "ideal_speedup": round(ideal_speedup(weights, per_slot, h2o.batch, h2o.context, h2o.kv_slots), 3),
        "speedup_vs_full": ratio("full", "h2o"),
        "speedup_vs_hf": ratio("hf", "h2o"),
        "bookkeeping_overhead": ratio("h2o", "slots"),
        "kv_share": round(h2o.kv_bytes / (per_slot * h2o.batch * h2o.context), 4),
    }
    if "h2o" + COMPILED in by_variant:
        out["bookkeeping_overhead_compiled"] = ratio("h2o" + COMPILED, "slots" + COMPILED)
        out["compile_speedup"] = ratio("h2o", "h2o" + COMPILED)  # eager ms / compiled ms
        out["compile_speedup_slots"] = ratio("slots", "slots" + COMPILED)
        out["speedup_vs_full_compiled"] = ratio("full", "h2o" + COMPILED)
    return out


# issue 18: decode cost per step with recall against the same policy without it, same device slots
RECALL_TARGETS = ((2048, 1.15), (8192, 1.25))  # (up to this many tokens of context, the largest ratio)


def recall_target(context: int) -> float | None:
    """The ratio a context is held to: 1.15 up to 2K tokens, 1.25 up to 8K, none stated beyond."""
    return next((ratio for length, ratio in RECALL_TARGETS if context <= length), None)


def recall_overhead(h2o: Measurement, recall: Measurement) -> dict:
    """One (context, batch) of ``recall_overhead``: recall's ms per step over h2o's (same policy,
    same device slots, measured in turns), the target, whether it is met, and the tier's bytes."""
    tier = recall.recall
    ratio = recall.median_ms / h2o.median_ms
    target = recall_target(h2o.context)
    cpu = {}
    if h2o.cpu_ms and recall.cpu_ms:  # on a CPU: the same ratio in CPU time, robust to the machine's load
        cpu = {"cpu_ms_per_step": round(h2o.cpu_ms, 3), "recall_cpu_ms_per_step": round(recall.cpu_ms, 3),
               "cpu_ratio": round(recall.cpu_ms / h2o.cpu_ms, 3)}
    return {
        "context": h2o.context, "batch": h2o.batch, "compiled": recall.compiled, "device_slots": recall.kv_slots,
        "recall_slots": tier["recall_slots"], "page": tier["page"], "selector": tier["selector"],
        "every": tier["every"], "cold_dtype": tier["cold_dtype"],
        "ms_per_step": round(h2o.median_ms, 3), "recall_ms_per_step": round(recall.median_ms, 3),
        "ratio": round(ratio, 3), "target": target, "met": None if target is None else ratio <= target,
        "kv_bytes": recall.kv_bytes, "digest_device_bytes": tier["digest_device_bytes"],
        "cold_host_bytes": tier["cold_host_bytes"], "pages_copied_per_step": tier["pages_copied_per_step"], **cpu,
    }


@dataclass
class BenchPlan:
    contexts: Sequence[int]
    batches: Sequence[int]
    budget_slots: Callable[[int], int]  # slots for a context length
    steps: int = 10
    warmup: int = 2
    kv_memory: int | None = 2 * 2**30
    max_batch: int = 32
    capacity_steps: int = 4
    repeats: int = 1  # turns each variant takes at each (context, batch); steps pooled
    variants: Sequence[str] = VARIANTS
    policy: object = "h2o"  # a Policy or a policy spec (name:knob=value)
    compile: bool = False  # also time h2o and slots with the decode step compiled (h2ochat.compiled)
    count_ops: bool = True  # profile one decode step of h2o and slots (and compiled) for its operation count
    recall: object = None  # CacheSettings with --recall: adds the recall variant beside h2o (eager)

    def __post_init__(self):
        if self.recall is not None and "h2o" not in self.variants:
            raise ValueError("--recall is measured beside h2o: keep h2o among the variants")
        # whole blocks of --recall-every steps (one recall each) in every measurement
        self.steps = -(-self.steps // self.block) * self.block

    @property
    def block(self) -> int:
        return self.recall.recall_every if self.recall is not None else 1

    def runs(self) -> list[tuple[str, bool]]:
        """(variant, compiled) in the order they take turns at each context and batch; recall right
        after h2o."""
        variants = [v for name in self.variants for v in ((name, RECALL) if name == "h2o" and self.recall else (name,))]
        runs = [(variant, False) for variant in variants]
        if self.compile:
            runs += [(variant, True) for variant in variants if variant in self.compilable()]
        return runs

    def compilable(self) -> tuple[str, ...]:
        # the compiled step takes recall only when every step recalls (RecallSpec.compile_blocker)
        return COMPILABLE_VARIANTS + ((RECALL,) if self.recall is not None and self.block == 1 else ())

    def profiled(self) -> list[tuple[str, bool]]:
        profiled = (*COMPILABLE_VARIANTS, RECALL)
        return [(v, c) for v, c in self.runs() if v in profiled] if self.count_ops else []

    def measurements(self) -> int:
        count = len(self.contexts) * len(self.batches) * len(self.runs()) * self.repeats + len(self.profiled())
        if self.kv_memory:
            count += len(self.contexts) * len([v for v in CAPACITY_VARIANTS if v in self.variants])
        return count


def capacity_batch(variant: str, *, kv_memory: int, per_slot: int, context: int, slots: int, extra: int) -> int:
    """The largest batch whose KV cache fits in ``kv_memory`` bytes."""
    held = slots if variant == "h2o" else context + extra
    return kv_memory // (per_slot * held)


def run(model, plan: BenchPlan, on_measured: Callable[[str], None] | None = None) -> dict:
    # inductor's CPU kernels show in the profiler only when compiled with a record per kernel
    if not (plan.compile and plan.count_ops):
        return _run(model, plan, on_measured)
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        return _run(model, plan, on_measured)


def decode_steps(plan: BenchPlan) -> int:
    """Tokens a measurement feeds after its context: the timed and warm-up steps, the first token,
    and the untimed compiling step."""
    return plan.steps + plan.warmup + 1 + int(plan.compile)


def check_contexts(model, plan: BenchPlan) -> None:
    """Every context plus its decode steps within the model's position limit (a ValueError)."""
    limit, extra = max_positions(model.config), decode_steps(plan)
    for context in plan.contexts:
        if context + extra > limit:
            raise ValueError(f"--context {context} + {extra} decode steps pass the model's {limit}-position limit")


def _run(model, plan: BenchPlan, on_measured: Callable[[str], None] | None) -> dict:
    device = next(model.parameters()).device
    memory = PeakMemory(device)
    check_contexts(model, plan)
    extra = decode_steps(plan)
    weights, per_slot = weight_bytes(model), kv_bytes_per_slot(model)
    results, comparisons, capacity, ops, overhead = [], [], [], [], []

    def one(variant, context, batch, steps, warmup, compile=False):
        slots = plan.budget_slots(context)
        measured = measure(model, variant, context=context, batch=batch, slots=slots, steps=steps, warmup=warmup,
                           memory=memory, policy=plan.policy, compile=compile, recall=plan.recall, block=plan.block)
        if on_measured:
            on_measured(f"{variant}{COMPILED if compile else ''} context {context} batch {batch}")
        return measured

    for context in plan.contexts:
        for batch in plan.batches:
            # variants take turns, so a machine whose load drifts slows them alike
            by_variant: dict[str, Measurement] = {}
            for _ in range(plan.repeats):
                for variant, compiled in plan.runs():
                    measured = one(variant, context, batch, plan.steps, plan.warmup, compiled)
                    key = variant + (COMPILED if compiled else "")
                    if key in by_variant:
                        kept = by_variant[key]
                        kept.step_ms += measured.step_ms
                        kept.step_cpu_ms += measured.step_cpu_ms
                        kept.peak_memory_bytes = max(kept.peak_memory_bytes, measured.peak_memory_bytes)
                        if measured.peak_memory_growth_bytes is not None:
                            kept.peak_memory_growth_bytes = max(kept.peak_memory_growth_bytes or 0,
                                                                measured.peak_memory_growth_bytes)
                    else:
                        by_variant[key] = measured
            results += [m.record() for m in by_variant.values()]
            if "h2o" in by_variant:
                comparisons.append(comparison(by_variant, weights, per_slot))
            for suffix in ("", COMPILED):  # eager, and with --compile the compiled steps
                if RECALL + suffix in by_variant and "h2o" + suffix in by_variant:
                    overhead.append(recall_overhead(by_variant["h2o" + suffix], by_variant[RECALL + suffix]))
            if not ops:  # operations per step: once, at the first context and batch (after its timing compiled)
                for variant, compiled in plan.profiled():
                    ops.append({"context": context, "batch": batch, **profile_ops(
                        model, variant, context=context, batch=batch, slots=plan.budget_slots(context),
                        policy=plan.policy, compile=compiled, recall=plan.recall)})
                    if on_measured:
                        on_measured(f"profiled {variant}{COMPILED if compiled else ''}")
        if plan.kv_memory:
            for variant in (v for v in CAPACITY_VARIANTS if v in plan.variants):
                largest = capacity_batch(variant, kv_memory=plan.kv_memory, per_slot=per_slot, context=context,
                                         slots=plan.budget_slots(context), extra=extra)
                entry = {"policy": variant, "context": context, "kv_memory_bytes": plan.kv_memory,
                         "max_batch": largest, "measured_batch": min(largest, plan.max_batch),
                         "decode_tokens_per_s": None, "peak_memory_bytes": None, "peak_memory_growth_bytes": None}
                if entry["measured_batch"] > 0:
                    measured = one(variant, context, entry["measured_batch"], plan.capacity_steps, 1)
                    entry["decode_tokens_per_s"] = round(measured.decode_tokens_per_s, 2)
                    entry["peak_memory_bytes"] = measured.peak_memory_bytes
                    entry["peak_memory_growth_bytes"] = measured.peak_memory_growth_bytes
                elif on_measured:
                    on_measured(f"{variant} context {context}: no batch fits")
                capacity.append(entry)
    report = {
        "weight_bytes": weights,
        "kv_bytes_per_token": per_slot,
        "peak_memory_scope": memory.scope,
        "results": results,
        "comparisons": comparisons,
        "capacity": capacity,
        "ops_per_layer": ops,
        "ops_counting": ("torch.profiler, one decode step: top-level aten ops (not called from another aten op; "
                         "views included) plus fused inductor kernels; attention_ops_per_layer: inside the h2o "
                         "attention call, mean over layers (eager only); step_ops_per_layer: the whole step "
                         "(embeddings, norms, MLPs, logits, position ids) / layers"),
    }
    if plan.recall is not None:
        report["recall_overhead"] = overhead
        report["recall_overhead_note"] = (
            "ratio = recall ms per step / h2o ms per step: the same policy at the same device slots (R of them "
            "recall slots), measured in turns in one run; a context's older tokens fill the cold tier with random "
            "keys, so the pages recalled change more from step to step than with text; on a CPU cpu_ratio is the "
            "same ratio in the process's CPU time per step, which other jobs' load barely moves; "
            f"targets {', '.join(f'<= {r}x up to {n} tokens' for n, r in RECALL_TARGETS)} (issue 18)")
    return report


def parse_ints(text: str, option: str) -> list[int]:
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option} takes comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{option} takes positive whole numbers, got {text!r}")
    return list(dict.fromkeys(values))
