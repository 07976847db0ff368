"""One benchmark measurement: the median decode-step latency of a variant at one context and batch
(and on a CPU the process's CPU time per step), with its KV bytes and peak memory, as a
``Measurement``; stock transformers (``hf``) timed with its own ``DynamicCache``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..engine.attention import NAME as H2O_ATTENTION
from .bench_context import RECALL, compilable, decode_step, fill_synthetic_dynamic, prepared_cache
from .bench_memory import PeakMemory
from ..model_shape import cache_argument
from ..kv import H2OCache


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
    compiled: bool = False  # the decode step ran compiled (h2ochat.engine.compiled)
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

    def pool(self, other: "Measurement") -> None:
        """Take in ``other``, a later turn of the same variant at the same context and batch: its
        steps join these (one median over all turns), the peaks are the larger of the two. A method
        of its own so the run does not write a measurement's fields from outside."""
        self.step_ms += other.step_ms
        self.step_cpu_ms += other.step_cpu_ms
        self.peak_memory_bytes = max(self.peak_memory_bytes, other.peak_memory_bytes)
        if other.peak_memory_growth_bytes is not None:
            self.peak_memory_growth_bytes = max(self.peak_memory_growth_bytes or 0, other.peak_memory_growth_bytes)

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
    if not blocks:
        raise ValueError(f"{len(step_ms)} timed steps hold no whole block of {block}")
    return statistics.median(sum(b) / len(b) for b in blocks)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kv_bytes_dynamic(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)


def _pages_copied(cache: H2OCache) -> int:
    record = cache.tier_record()
    return record["pages_copied"] if record is not None else 0


def _decode_tokens(model, steps: int, batch: int, compile: bool, generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """The tokens a measurement feeds [N, B, 1] (token 0 initialises the cache, token 1 compiles where ``compile``,
    then ``steps`` timed or warm-up steps), on the model's device, and the index of the first decode step."""
    first = 2 if compile else 1
    tokens = torch.randint(0, model.config.vocab_size, (steps + first, batch, 1), generator=generator)
    return first, tokens.to(next(model.parameters()).device)


def _timed(step, ids: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """One decode step ``step(ids)``: its wall and process CPU milliseconds (the device synchronised around it)."""
    sync(device)
    started, started_cpu = time.perf_counter(), time.process_time()
    step(ids)
    sync(device)
    return (time.perf_counter() - started) * 1000, (time.process_time() - started_cpu) * 1000


def measure(model, variant: str, *, context: int, batch: int, slots: int, steps: int, warmup: int,
            memory: PeakMemory, policy="h2o", seed: int = 0, compile: bool = False, recall=None,
            block: int = 1) -> Measurement:
    """Median decode-step latency of ``variant`` at ``batch`` sequences that have seen ``context``
    tokens, with KV bytes and peak memory. ``compile``: h2o and slots run the compiled step, after
    one untimed step that compiles it (or finds it compiled). ``recall``: the settings of the recall
    variant (``CacheSettings`` with --recall). ``block``: steps per timed block (see ``Measurement``)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    first, tokens = _decode_tokens(model, steps + warmup, batch, compile, generator)
    memory.reset()
    compiled, compile_s = False, None
    if variant == "hf":
        result = _measure_hf(model, tokens[first - 1:], context, generator, warmup)
    else:
        cache = prepared_cache(model, variant, tokens[0], context=context, slots=slots, extra=len(tokens) - 1,
                               policy=policy, generator=generator, recall=recall)
        step, compiled = decode_step(model, cache, compile and compilable(variant))
        if compile:
            started = time.perf_counter()
            step(tokens[1])
            sync(device)
            compile_s = time.perf_counter() - started if compiled else None
        step_ms, cpu_ms, copied = [], [], _pages_copied(cache)
        for index in range(first, len(tokens)):
            wall, cpu = _timed(step, tokens[index], device)
            step_ms.append(wall)
            cpu_ms.append(cpu)
        tier = recall_record(cache, _pages_copied(cache) - copied, len(step_ms))
        result = (cache.device_slots(), cache.kv_bytes(), step_ms[warmup:])
        cache.reset()  # its slots go back before the next measurement
    kv_slots, kv_bytes, step_ms = result
    return Measurement(variant, context, batch, kv_slots, kv_bytes, step_ms, memory.peak(), memory.growth(),
                       compiled, compile_s, block, tier if variant == RECALL else None,
                       cpu_ms[warmup:] if variant != "hf" and device.type == "cpu" else [])


@dataclass
class Paired:
    """Two variants' decode steps timed in alternation (``measure_paired``): each one's wall and CPU ms per step, in
    the order they ran, and the block the ratio is taken over."""
    variants: tuple[str, str]
    step_ms: tuple[list[float], list[float]]
    step_cpu_ms: tuple[list[float], list[float]]
    block: int

    def ratio(self, cpu: bool = False) -> float | None:
        """The second variant's time over the first's: the median over blocks of ``block`` steps of the ratio of their
        sums, each block's steps run side by side (None: no CPU times, off a CPU)."""
        first, second = self.step_cpu_ms if cpu else self.step_ms
        if not first:
            return None
        block = self.block
        sums = [(sum(first[i:i + block]), sum(second[i:i + block])) for i in range(0, len(first) - block + 1, block)]
        return statistics.median(b / a for a, b in sums)

    def record(self) -> dict:
        cpu = self.ratio(cpu=True)
        return {"variants": list(self.variants), "steps": len(self.step_ms[0]), "block": self.block,
                "ratio": round(self.ratio(), 3), **({"cpu_ratio": round(cpu, 3)} if cpu is not None else {})}


def measure_paired(model, variants: tuple[str, str], *, context: int, batch: int, slots: int, steps: int, warmup: int,
                   policy="h2o", seed: int = 0, compile: bool = False, recall=None, block: int = 1) -> Paired:
    """Two variants at the same context and batch, each on its own cache, their decode steps run in alternation (a b,
    b a, a b, ...: neither always first), so a change of the machine's speed, which moves a step by 10-20% on a shared
    machine from one minute to the next, falls on both alike: the ratio of their step times is read pair by pair,
    where separate turns of each (``measure``) put seconds between the two. Times only: no memory figures."""
    device = next(model.parameters()).device
    first, tokens = _decode_tokens(model, steps + warmup, batch, compile, torch.Generator().manual_seed(seed))
    runs = []
    for variant in variants:
        cache = prepared_cache(model, variant, tokens[0], context=context, slots=slots, extra=len(tokens) - 1,
                               policy=policy, generator=torch.Generator().manual_seed(seed + 1),
                               recall=recall if variant == RECALL else None)
        step, _ = decode_step(model, cache, compile and compilable(variant))
        runs.append((cache, step))
    times = ([], []), ([], [])
    for index in range(1, len(tokens)):
        order = (0, 1) if index % 2 else (1, 0)
        for which in order:
            wall, cpu = _timed(runs[which][1], tokens[index], device)
            times[0][which].append(wall)
            times[1][which].append(cpu)
    for cache, _ in runs:
        cache.reset()
    skip = warmup + first - 1  # (the compiling step and the warm-up are not timed)
    wall = tuple(ms[skip:] for ms in times[0])
    cpu = tuple(ms[skip:] for ms in times[1]) if device.type == "cpu" else ([], [])
    return Paired(tuple(variants), wall, cpu, block)


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
                wall, _ = _timed(lambda ids: model(input_ids=ids, position_ids=position, use_cache=True,
                                                   logits_to_keep=1, **argument), tokens[index], device)
                step_ms.append(wall)
        return cache.layers[0].keys.shape[2], _kv_bytes_dynamic(cache), step_ms[warmup:]
    finally:
        model.set_attn_implementation(H2O_ATTENTION)
