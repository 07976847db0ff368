"""`h2ochat bench`: decode speed and memory, budgeted cache vs full cache vs stock transformers."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .. import options as o
from ..budget import budget_bytes, parse_budget
from ..errors import strict_user_errors, user_input
from ..recall.default import is_off
from ..sizes import parse_size
from .common import constant_of, loading

# the benchmark imports torch: its variants are read from its source (--help stays fast), the module
# itself is imported when the command runs
VARIANTS = constant_of("measure.bench_context", "VARIANTS")

MIB = 2**20


@strict_user_errors
@o.takes_recall_options(recall=None)
def bench(
    model: o.Model = o.DEFAULTS["model"],
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    random_weights: o.RandomWeights = False,
    context: Annotated[str, typer.Option("--context", rich_help_panel=o.CACHE,
        help="Comma-separated context lengths (tokens already seen when decoding starts).")] = "512,1024,2048,4096",
    batch: Annotated[str, typer.Option("--batch", rich_help_panel=o.CACHE,
        help="Comma-separated batch sizes.")] = "1,4",
    budget: Annotated[str, typer.Option("--budget", "-b", rich_help_panel=o.CACHE,
        help="The budgeted caches' " + o.budget_help("each --context length", fits_at="the model's dtype")
             + " Run, generate, story and serve take a share of the context window instead.")] = "0.2",
    policy: o.Policy = o.DEFAULTS["policy"],
    heavy_ratio: o.HeavyRatio = None,
    sinks: o.Sinks = None,
    decay: o.Decay = None,
    variants: Annotated[str, typer.Option("--variants", rich_help_panel=o.CACHE,
        help="Comma-separated caches to time, some of " + ", ".join(VARIANTS) + " (--recall adds recall beside h2o).")]
        = ",".join(VARIANTS),
    kv_memory: Annotated[str, typer.Option("--kv-memory", rich_help_panel=o.CACHE,
        help="KV memory cap for the largest-batch comparison (2GiB, 512MiB); 0 skips it.")] = "2GiB",
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, rich_help_panel=o.CACHE,
        help="Largest batch actually run for the KV-cap comparison (the fitting batch is still reported).")] = 32,
    steps: Annotated[int, typer.Option("--steps", min=1, rich_help_panel=o.CACHE,
        help="Timed decode steps per measurement (the median is reported).")] = 10,
    warmup: Annotated[int, typer.Option("--warmup", min=0, rich_help_panel=o.CACHE,
        help="Untimed decode steps before them.")] = 2,
    repeats: Annotated[int, typer.Option("--repeats", min=1, rich_help_panel=o.CACHE,
        help="Turns each variant takes at each context and batch (interleaved; steps pooled for the median).")] = 1,
    compile: Annotated[bool, typer.Option("--compile", rich_help_panel=o.MODEL,
        help="Also time h2o and slots with the decode step compiled (torch.compile), taking turns with their "
             "eager runs; each new shape compiles once, untimed (minutes on a CPU).")] = False,
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", rich_help_panel=o.CACHE,
        help=o.listed(o.KvDtype, "Comma-separated slot dtypes to time h2o with beside its own slots (the model's "
                                 "dtype), in turns: at h2o's slots and at the slots that fit h2o's bytes."))] = "auto",
    as_json: o.Json = False,
    recall_options: dict | None = None,  # --recall and its options (o.takes_recall_options)
):
    """Decode tokens/s, latency and memory: h2o vs its own slots without bookkeeping vs a full
    cache vs stock transformers, at each context length and batch size, and under a KV memory cap;
    and the operations one decode step runs per layer (torch.profiler). With --recall, the same
    policy with recall at the same device slots beside h2o, and the recall overhead per step."""
    from ..measure import benchmark as bm

    settings = o.cache_settings(policy, budget, heavy_ratio, sinks, "absolute", None, decay, **recall_options)
    with user_input():  # the options as typed
        contexts = bm.parse_ints(context, "--context")
        batches = bm.parse_ints(batch, "--batch")
        chosen_variants = parse_variants(variants)
        from ..measure.evaluation import parse_kv_dtypes

        kv_dtypes = [name for name in parse_kv_dtypes(kv_dtype) if name != "auto"]
        if kv_dtypes and "h2o" not in chosen_variants:
            raise ValueError("--kv-dtype is timed beside h2o: keep h2o among the --variants")
        cap = None if kv_memory.strip() in ("0", "") else parse_size(kv_memory)
        chosen = settings.resolved_policy()
        recall_on = not is_off(recall_options["recall"])  # (--recall 0: the same as no --recall)
        if recall_on and chosen.grows:
            raise ValueError(f"--recall needs a policy that evicts, not {chosen.label}")

        def check_split(slots: int, recall_budget: int) -> None:
            """The policy's share of ``slots`` (less recall's) splits: one-line errors, not a traceback later."""
            tier = settings.recall_config(recall_budget)
            chosen.split(slots - (tier.slots if tier else 0))

        sized = budget_bytes(budget) is not None  # a size (16MiB): its slots wait for the model
        for length in ([] if sized else contexts):
            slots = parse_budget(budget, length)  # bad syntax fails before the model loads
            check_split(slots, min(slots, length))
    from .. import threads
    from ..engine.packed_linears import form_of
    from ..loading.models import load

    from ..console import make_console  # reads no markup: a label such as h2o [int8] prints as it is
    err = make_console(stderr=True)
    with loading(err, model):
        loaded = load(model, device, dtype, random_weights=random_weights, decode_rows=max(batches))
    with user_input():
        if sized:  # the slots whose bytes (at the model's dtype) fit the size, at every context length
            fitting = settings.slots(loaded.model.config, loaded.model)
            check_split(fitting, fitting)
        plan = bm.BenchPlan(contexts, batches, (lambda length: min(fitting, length)) if sized else
                            (lambda length: min(parse_budget(budget, length), length)),
                            steps=steps, warmup=warmup, repeats=repeats, kv_memory=cap, max_batch=max_batch,
                            policy=chosen, compile=compile, variants=chosen_variants,
                            recall=settings if recall_on else None, kv_dtypes=kv_dtypes)
        bm.check_contexts(loaded.model, plan)  # against this model's position limit
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[last]}", markup=False), console=err, transient=True,
                  disable=not err.is_terminal) as progress:
        task = progress.add_task("measuring", total=plan.measurements(), last="")
        report = bm.run(loaded.model, plan, on_measured=lambda what: progress.update(task, advance=1, last=what))
    report = {"model": loaded.name, "device": str(loaded.device),
              "dtype": str(loaded.dtype).removeprefix("torch."), "budget": budget,
              "policy": chosen.label, "recall": recall_options["recall"] if recall_on else None,
              "threads": threads.current(), "linears": form_of(loaded.model), **report}
    if as_json:
        print(json.dumps(report, indent=2))
        return
    _print(report)


def _print(report: dict) -> None:
    from ..console import make_console
    out = make_console()
    speed = Table(title=f"Decode at each context and batch ({report['model']}, {report['dtype']}, {report['device']}): "
                        "median ms per step, tokens/s, KV MiB, peak MiB (and its rise during the measurement)", title_justify="left")
    for name in ("context", "batch", "policy", "KV slots", "ms/step", "tokens/s", "KV MiB", "peak MiB"):
        speed.add_column(name, justify="right" if name != "policy" else "left")
    for r in report["results"]:
        name = r["policy"] + (" compiled" if r.get("compiled") else "")
        speed.add_row(str(r["context"]), str(r["batch"]), name, str(r["kv_slots"]), f"{r['ms_per_step']:.1f}",
                      f"{r['decode_tokens_per_s']:.1f}", f"{r['kv_bytes'] / MIB:.1f}", _peak(r))
    out.print(speed)
    if report.get("recall_overhead"):
        _print_recall(out, report["recall_overhead"])
    quantized = [dict(q, context=c["context"], batch=c["batch"]) for c in report["comparisons"]
                 for q in c.get("quantized", [])]
    if quantized:
        _print_quantized(out, quantized)
    compare = Table(title="h2o speed-up: ideal (memory-bound byte ratio) vs measured; bookkeeping = h2o / same slots "
                          "without scoring or eviction", title_justify="left")
    compiled = any("compile_speedup" in c for c in report["comparisons"])
    columns = ["context", "batch", "h2o slots", "KV share", "ideal", "vs full", "vs hf", "bookkeeping"]
    if compiled:
        columns += ["bookkeeping compiled", "compile speed-up h2o", "compile speed-up slots"]
    for name in columns:
        compare.add_column(name, justify="right")
    fmt = lambda v, suffix="x": "-" if v is None else f"{v:.2f}{suffix}"  # noqa: E731
    for c in report["comparisons"]:
        row = [str(c["context"]), str(c["batch"]), str(c["kv_slots"]), f"{c['kv_share']:.3f}",
               fmt(c["ideal_speedup"]), fmt(c["speedup_vs_full"]), fmt(c["speedup_vs_hf"]),
               fmt(c["bookkeeping_overhead"])]
        if compiled:
            row += [fmt(c.get("bookkeeping_overhead_compiled")), fmt(c.get("compile_speedup")),
                    fmt(c.get("compile_speedup_slots"))]
        compare.add_row(*row)
    out.print(compare)
    if report.get("ops_per_layer"):
        ops = Table(title="Operations per decode step (torch.profiler: top-level aten ops, views included, and fused "
                          "inductor kernels)", title_justify="left")
        for name in ("cache", "in attention, per layer", "whole step, per layer", "whole step"):
            ops.add_column(name, justify="right" if name != "cache" else "left")
        for entry in report["ops_per_layer"]:
            attention = entry["attention_ops_per_layer"]
            ops.add_row(entry["policy"] + (" compiled" if entry["compiled"] else ""),
                        "-" if attention is None else f"{attention:g}", f"{entry['step_ops_per_layer']:g}",
                        str(entry["step_ops"]))
        out.print(ops)
    if report["capacity"]:
        cap = report["capacity"][0]["kv_memory_bytes"]
        table = Table(title=f"Largest batch whose KV cache fits in {cap / 2**30:.2f} GiB, and its decode throughput",
                      title_justify="left")
        for name in ("context", "policy", "max batch", "run at", "tokens/s"):
            table.add_column(name, justify="right" if name != "policy" else "left")
        for c in report["capacity"]:
            table.add_row(str(c["context"]), c["policy"], str(c["max_batch"]), str(c["measured_batch"]),
                          "-" if c["decode_tokens_per_s"] is None else f"{c['decode_tokens_per_s']:.1f}")
        out.print(table)
    out.print(f"peak memory: {report['peak_memory_scope']}; weights {report['weight_bytes'] / MIB:.0f} MiB, "
              f"KV {report['kv_bytes_per_token'] / 1024:.1f} KiB per token per sequence")


def parse_variants(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"--variants takes some of {', '.join(VARIANTS)}, got {text!r}")
    return list(dict.fromkeys(names))


def _print_recall(out: Console, overhead: list[dict]) -> None:
    first = overhead[0]
    table = Table(title=f"Recall overhead (targets: <= 1.15x at 2K tokens, <= 1.25x at 8K): ms per decode step with "
                        f"recall / the same policy without it at the same device slots; selector {first['selector']}, "
                        f"pages of {first['page']}, recall every {first['every']} step(s), cold {first['cold_dtype']}",
                  title_justify="left")
    for name in ("context", "batch", "slots (recall)", "ms/step", "recall", "ratio", "CPU-time ratio", "target",
                 "met", "digest MiB", "cold MiB", "pages/step"):
        table.add_column(name, justify="right")
    for c in overhead:
        cpu = c.get("cpu_ratio")
        table.add_row(f"{c['context']}{' compiled' if c.get('compiled') else ''}", str(c["batch"]),
                      f"{c['device_slots']} ({c['recall_slots']})",
                      f"{c['ms_per_step']:.1f}", f"{c['recall_ms_per_step']:.1f}", f"{c['ratio']:.2f}x",
                      "-" if cpu is None else f"{cpu:.2f}x",
                      "-" if c["target"] is None else f"{c['target']:.2f}x",
                      {True: "yes", False: "NO", None: "-"}[c["met"]], f"{c['digest_device_bytes'] / MIB:.2f}",
                      f"{c['cold_host_bytes'] / MIB:.1f}", f"{c['pages_copied_per_step']:.2f}")
    out.print(table)
    out.print("ratio: recall's steps over h2o's, run in alternation on two caches (the median block's); met: the "
              "CPU-time ratio against the target on a CPU (other jobs' load barely moves it), else the wall-clock one; "
              "ms/step, recall: the medians of their own turns; digest MiB: the page digests on the device; cold MiB: "
              "the cold stores in host memory; pages/step: pages copied into the recall slots per step and (layer, "
              "sequence, KV head)")


def _print_quantized(out: Console, rows: list[dict]) -> None:
    table = Table(title="Quantized slots: ms per decode step against h2o's own (the model's dtype) at the same slots "
                        "and at the same KV bytes (wall-clock ratio; CPU-time ratio in brackets on a CPU)",
                  title_justify="left")
    for name in ("context", "batch", "kv dtype", "h2o slots", "ms/step", "same slots", "ratio", "same bytes: slots",
                 "ms/step ", "ratio "):
        table.add_column(name, justify="right")
    for q in rows:
        def ratio(label):
            text = f"{q[label + '_ratio']:.2f}x" if label + "_ratio" in q else "-"
            return text + (f" [{q[label + '_cpu_ratio']:.2f}x]" if label + "_cpu_ratio" in q else "")
        table.add_row(str(q["context"]), str(q["batch"]), q["kv_dtype"] + (" compiled" if q["compiled"] else ""),
                      str(q["h2o_slots"]), f"{q['h2o_ms_per_step']:.1f}", f"{q.get('same_slots_ms_per_step', 0):.1f}",
                      ratio("same_slots"), str(q.get("same_bytes_slots", "-")),
                      f"{q.get('same_bytes_ms_per_step', 0):.1f}", ratio("same_bytes"))
    out.print(table)


def _peak(record: dict) -> str:
    text = f"{record['peak_memory_bytes'] / MIB:.0f}"
    growth = record.get("peak_memory_growth_bytes")
    return text if growth is None else f"{text} (+{growth / MIB:.0f})"


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
