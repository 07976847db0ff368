"""The compiled recall decode step: how long it builds cold, how many graphs, and its step time against
eager recall and compiled h2o at the same device slots (SmolLM2-135M's configuration, random weights,
fp32, batch 1, synthetic context as ``h2ochat bench`` builds it).

    OMP_NUM_THREADS=1 python benchmarks/recall_compile.py --context 2048 --steps 48 --json

"Cold": a fresh inductor cache directory (TORCHINDUCTOR_CACHE_DIR, FX graph cache off), so the build is
what a first run on a machine pays. Graphs and recompiles from dynamo's counters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="h2o-recall-compile-"))
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from h2ochat.measure.bench_context import prepared_cache  # noqa: E402
from h2ochat.engine.compiled import CompiledDecode  # noqa: E402
from h2ochat.engine.forward_step import forward  # noqa: E402
from h2ochat.engine.generation import CacheSettings  # noqa: E402
from h2ochat.loading.models import load  # noqa: E402
from json_report import emit  # noqa: E402


def _steps(step, steps: int, vocab: int, generator) -> list[float]:
    times = []
    for _ in range(steps):
        ids = torch.randint(3, vocab, (1, 1), generator=generator)
        start = time.perf_counter()
        step(ids)
        times.append((time.perf_counter() - start) * 1000)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--recall", type=str, default="64")
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers (a smaller build to profile)")
    parser.add_argument("--variants", default="h2o,recall")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    loaded = load("smollm2-135m", "cpu", "float32", random_weights=True)
    model, vocab = loaded.model, loaded.model.config.vocab_size
    if args.layers is not None:  # (a profile of the build at a smaller scale: the graph is per layer the same)
        model.model.layers = model.model.layers[: args.layers]
        model.config.num_hidden_layers = args.layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[: args.layers]
    settings = CacheSettings(policy="h2o", budget=str(args.budget), recall=args.recall, recall_every=args.every)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # (every step's ids alike: a tensor made outside it is another graph's input)
        first = torch.randint(3, vocab, (1, 1), generator=generator)
    report = {"layers": args.layers or model.config.num_hidden_layers, "context": args.context, "budget": args.budget, "recall": args.recall, "every": args.every,
              "inductor_cache": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
    times = {}
    with torch.inference_mode():
        for name, recall in [(n, r) for n, r in (("h2o", None), ("recall", settings)) if n in args.variants.split(",")]:
            variant = "recall" if recall is not None else "h2o"
            eager_cache = prepared_cache(model, variant, first, context=args.context, slots=args.budget, extra=args.steps + 8,
                                         policy="h2o", generator=torch.Generator().manual_seed(1), recall=recall)
            cache = prepared_cache(model, variant, first, context=args.context, slots=args.budget, extra=args.steps + 8,
                                   policy="h2o", generator=torch.Generator().manual_seed(1), recall=recall)
            decoder = CompiledDecode(model)
            assert decoder.prepare(cache), cache.compile_blocker()
            graphs = counters["stats"]["unique_graphs"]
            start, cpu = time.perf_counter(), time.process_time()
            decoder(cache, first.view(-1))
            report[f"{name}_compile_s"] = round(time.perf_counter() - start, 1)
            report[f"{name}_compile_cpu_s"] = round(time.process_time() - cpu, 1)  # (robust to a loaded machine)
            compiled = _steps(lambda ids: decoder(cache, ids.view(-1)), args.steps, vocab, generator)
            report[f"{name}_graphs"] = counters["stats"]["unique_graphs"] - graphs
            eager = _steps(lambda ids: forward(model, eager_cache, ids, logits_to_keep=1), args.steps, vocab, generator)
            times[name] = {"compiled_ms": statistics.mean(compiled), "eager_ms": statistics.mean(eager)}
            print(f"{name}: compile {report[f'{name}_compile_s']} s, compiled {times[name]['compiled_ms']:.1f} ms/step, "
                  f"eager {times[name]['eager_ms']:.1f} ms/step", file=sys.stderr)
    report["recompiles"] = dict(counters["recompiles"]) if "recompiles" in counters else {}
    report["graph_breaks"] = sum(counters["graph_break"].values()) if "graph_break" in counters else 0
    report["ms_per_step (mean over the steps, flushes and recalls included)"] = {
        name: {k: round(v, 2) for k, v in t.items()} for name, t in times.items()}
    if "recall" in times:
        report["compiled_recall_over_eager_recall"] = round(times["recall"]["compiled_ms"] / times["recall"]["eager_ms"], 3)
    if "recall" in times and "h2o" in times:
        report["compiled_recall_over_compiled_h2o"] = round(times["recall"]["compiled_ms"] / times["h2o"]["compiled_ms"], 3)
    if args.json:
        emit(report, None)
    else:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
