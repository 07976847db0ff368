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
decode step compiled (``h2ochat.engine.compiled``), taking turns with their eager runs; the compilation
happens in one untimed step before the warm-up and is reported as ``compile_s``.

This module holds the plan (``BenchPlan``), the run that takes the measurements in turns, and the
report's comparisons and capacity; beside it, one job each: bench_context.py (a cache that has seen
N tokens, without an N-token prefill), bench_measure.py (one timed measurement), bench_memory.py
(peak memory), bench_ops.py (launches: operations per decode step, from torch.profiler).

KV bytes come from the caches' own allocations.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Callable, Sequence

from .bench_context import COMPILABLE_VARIANTS, RECALL, VARIANTS, quantized_variants
from .bench_measure import Measurement, Paired, measure, measure_paired
from .bench_memory import PeakMemory
from .bench_ops import profile_ops
from ..engine.generation import max_positions
from ..loading.memory import kv_bytes
from ..engine.packed_linears import weight_bytes

CAPACITY_VARIANTS = ("h2o", "full", "hf")


def kv_bytes_per_slot(model) -> int:
    """Bytes of keys + values one token takes across all layers and KV heads, for one sequence."""
    return kv_bytes(model.config, slots=1, batch=1, dtype=next(model.parameters()).dtype)


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
    out.update(quantized_comparison(by_variant))
    if "h2o" + COMPILED in by_variant:
        out["bookkeeping_overhead_compiled"] = ratio("h2o" + COMPILED, "slots" + COMPILED)
        out["compile_speedup"] = ratio("h2o", "h2o" + COMPILED)  # eager ms / compiled ms
        out["compile_speedup_slots"] = ratio("slots", "slots" + COMPILED)
        out["speedup_vs_full_compiled"] = ratio("full", "h2o" + COMPILED)
    return out


def quantized_comparison(by_variant: dict[str, Measurement]) -> dict:
    """The quantized steps against h2o's at one (context, batch), eager and compiled: ms per step at
    the same slots and at the same bytes, and their ratios (wall and, on a CPU, CPU time)."""
    rows = []
    dtypes = dict.fromkeys(name[len("h2o["):name.index("]")] for name in by_variant if name.startswith("h2o["))
    for suffix in ("", COMPILED):
        h2o = by_variant.get("h2o" + suffix)
        for kv_dtype in dtypes:
            same_slots, same_bytes = quantized_variants(kv_dtype)
            if h2o is None or same_slots + suffix not in by_variant:
                continue
            entry = {"kv_dtype": kv_dtype, "compiled": bool(suffix), "h2o_slots": h2o.kv_slots,
                     "h2o_kv_bytes": h2o.kv_bytes, "h2o_ms_per_step": round(h2o.median_ms, 3)}
            for label, key in (("same_slots", same_slots + suffix), ("same_bytes", same_bytes + suffix)):
                measured = by_variant.get(key)
                if measured is None:
                    continue
                entry.update({f"{label}_slots": measured.kv_slots, f"{label}_kv_bytes": measured.kv_bytes,
                              f"{label}_ms_per_step": round(measured.median_ms, 3),
                              f"{label}_ratio": round(measured.median_ms / h2o.median_ms, 3)})
                if measured.cpu_ms and h2o.cpu_ms:
                    entry[f"{label}_cpu_ratio"] = round(measured.cpu_ms / h2o.cpu_ms, 3)
            rows.append(entry)
    return {"quantized": rows} if rows else {}


# the recall targets: decode cost per step with recall against the same policy without it, same device slots
RECALL_TARGETS = ((2048, 1.15), (8192, 1.25))  # (up to this many tokens of context, the largest ratio)


def recall_target(context: int) -> float | None:
    """The ratio a context is held to: 1.15 up to 2K tokens, 1.25 up to 8K, none stated beyond."""
    return next((ratio for length, ratio in RECALL_TARGETS if context <= length), None)


def recall_overhead(h2o: Measurement, recall: Measurement, paired: Paired | None = None) -> dict:
    """One (context, batch) of ``recall_overhead``: recall's ms per step over h2o's (same policy, same device
    slots), the target, whether it is met, and the tier's bytes. The ratio is ``paired``'s where given (their steps
    in alternation, the median block's ratio; on a CPU its CPU time's decides), else that of their turns' medians;
    the turns' figures are reported either way (``turns_ratio``)."""
    tier = recall.recall
    turns = recall.median_ms / h2o.median_ms
    ratio = paired.ratio() if paired is not None else turns
    target = recall_target(h2o.context)
    cpu = {}
    if h2o.cpu_ms and recall.cpu_ms:  # on a CPU: the same ratio in CPU time, robust to the machine's load
        cpu_ratio = paired.ratio(cpu=True) if paired is not None else None
        cpu = {"cpu_ms_per_step": round(h2o.cpu_ms, 3), "recall_cpu_ms_per_step": round(recall.cpu_ms, 3),
               "turns_cpu_ratio": round(recall.cpu_ms / h2o.cpu_ms, 3),
               "cpu_ratio": round(cpu_ratio if cpu_ratio is not None else recall.cpu_ms / h2o.cpu_ms, 3)}
    return {
        "context": h2o.context, "batch": h2o.batch, "compiled": recall.compiled, "device_slots": recall.kv_slots,
        "recall_slots": tier["recall_slots"], "page": tier["page"], "selector": tier["selector"],
        "every": tier["every"], "cold_dtype": tier["cold_dtype"],
        "ms_per_step": round(h2o.median_ms, 3), "recall_ms_per_step": round(recall.median_ms, 3),
        "ratio": round(ratio, 3), "turns_ratio": round(turns, 3),
        **({"side_by_side": paired.record()} if paired is not None else {}),
        "target": target, "met": None if target is None else cpu.get("cpu_ratio", ratio) <= target,
        "kv_bytes": recall.kv_bytes, "digest_device_bytes": tier["digest_device_bytes"],
        "cold_host_bytes": tier["cold_host_bytes"], "pages_copied_per_step": tier["pages_copied_per_step"], **cpu,
        # the tier's device bytes beyond its recall columns (selector + staging + frames), against the KV slots'
        **({"device_bytes": tier["device_bytes"], "device_bytes_share": round(tier["device_bytes"] / recall.kv_bytes, 4),
            **{name: tier[name] for name in ("device_bytes_selector", "device_bytes_staging", "device_bytes_frames",
                                             "pages_per_summary")}} if "device_bytes" in tier else {}),
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
    compile: bool = False  # also time h2o and slots with the decode step compiled (h2ochat.engine.compiled)
    count_ops: bool = True  # profile one decode step of h2o and slots (and compiled) for its operation count
    recall: object = None  # CacheSettings with --recall: adds the recall variant beside h2o (eager)
    # --kv-dtype: h2o with its slots in each, at h2o's slots and at h2o's bytes, beside h2o (in turns)
    kv_dtypes: Sequence[str] = ()

    def __post_init__(self):
        if self.recall is not None and "h2o" not in self.variants:
            raise ValueError("--recall is measured beside h2o: keep h2o among the variants")
        # whole blocks of --recall-every steps (one recall each) in every measurement
        self.steps = -(-self.steps // self.block) * self.block

    @property
    def block(self) -> int:
        # a block holds whole recall cadences and one flush of the staging page (every --page decode steps)
        return math.lcm(self.recall.recall_every, self.recall.page) if self.recall is not None else 1

    def runs(self) -> list[tuple[str, bool]]:
        """(variant, compiled) in the order they take turns at each context and batch; recall right
        after h2o."""
        variants = [v for name in self.variants for v in ((name, RECALL) if name == "h2o" and self.recall else (name,))]
        if "h2o" in variants:  # the quantized steps right after h2o's
            at = variants.index("h2o") + 1
            variants[at:at] = [v for name in self.kv_dtypes for v in quantized_variants(name)]
        runs = [(variant, False) for variant in variants]
        if self.compile:
            runs += [(variant, True) for variant in variants if variant in self.compilable()]
        return runs

    def compilable(self) -> tuple[str, ...]:
        # the compiled step takes recall at any cadence (pages are chosen before the step: RecallSpec.compile_blocker)
        quantized = tuple(v for name in self.kv_dtypes for v in quantized_variants(name))
        return COMPILABLE_VARIANTS + quantized + ((RECALL,) if self.recall is not None else ())

    def profiled(self) -> list[tuple[str, bool]]:
        profiled = (*COMPILABLE_VARIANTS, RECALL)
        return [(v, c) for v, c in self.runs() if v in profiled] if self.count_ops else []

    def measurements(self) -> int:
        count = len(self.contexts) * len(self.batches) * len(self.runs()) * self.repeats + len(self.profiled())
        if self.recall is not None:  # (recall and h2o side by side once more: ``measure_paired``)
            count += len(self.contexts) * len(self.batches) * (1 + self.compile)
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

    def one(variant, context, batch, steps, warmup, compile=False, block=plan.block):
        slots = plan.budget_slots(context)
        measured = measure(model, variant, context=context, batch=batch, slots=slots, steps=steps, warmup=warmup,
                           memory=memory, policy=plan.policy, compile=compile, recall=plan.recall, block=block)
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
                        by_variant[key].pool(measured)
                    else:
                        by_variant[key] = measured
            results += [m.record() for m in by_variant.values()]
            if "h2o" in by_variant:
                comparisons.append(comparison(by_variant, weights, per_slot))
            for suffix in ("", COMPILED):  # eager, and with --compile the compiled steps
                if RECALL + suffix in by_variant and "h2o" + suffix in by_variant:
                    paired = measure_paired(model, ("h2o", RECALL), context=context, batch=batch,
                                            slots=plan.budget_slots(context), steps=plan.steps * plan.repeats,
                                            warmup=plan.warmup, policy=plan.policy, compile=bool(suffix),
                                            recall=plan.recall, block=plan.block)
                    if on_measured:
                        on_measured(f"h2o and recall{suffix} side by side, context {context} batch {batch}")
                    overhead.append(recall_overhead(by_variant["h2o" + suffix], by_variant[RECALL + suffix], paired))
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
                    # no recall in a capacity row: timed step by step (its few steps hold no whole recall block)
                    measured = one(variant, context, entry["measured_batch"], plan.capacity_steps, 1, block=1)
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
            "recall slots), their decode steps run in alternation on two caches (side_by_side: the median over "
            "blocks of the ratio of their sums; turns_ratio: the medians of their separate turns); a context's older "
            "tokens fill the cold tier with random keys, so the pages recalled change more from step to step than "
            "with text; on a CPU cpu_ratio is the same ratio in the process's CPU time per step, and decides met; "
            f"targets {', '.join(f'<= {r}x up to {n} tokens' for n, r in RECALL_TARGETS)}")
    return report


def parse_ints(text: str, option: str) -> list[int]:
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option} takes comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{option} takes positive whole numbers, got {text!r}")
    return list(dict.fromkeys(values))
