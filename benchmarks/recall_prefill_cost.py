"""What the rest costs a prompt: the time to prefill a real text in the product's chunks (512 tokens) with
recall and ``--recall-rest`` prompt / pages / auto / off, against the policy alone at the same device slots,
side by side in one run (the variants take turns, each repeat in a new order; medians and ratios).

    python benchmarks/recall_prefill_cost.py --text /work/shared/data/gfdl-1.3.txt --tokens 2048,3600 \
        --budget 512 --rests off,prompt --repeats 3 --threads 1 > cost.json

Real weights (SmolLM2-135M in bf16 by default: the dtype where the rest's C call runs on a CPU with
AVX512-BF16). The decode step's cost is ``h2ochat bench``'s; this is the prompt's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from h2ochat import threads
from h2ochat.engine.generation import CacheSettings, prefill
from h2ochat.loading.models import load
from json_report import emit


def _variants(budget: int, recall: str, rests: list[str]) -> dict[str, CacheSettings]:
    variants = {"h2o": CacheSettings(policy="h2o", budget=str(budget))}
    for rest in rests:
        variants[f"recall, rest {rest}"] = CacheSettings(policy="h2o", budget=str(budget), recall=recall,
                                                         recall_rest=rest)
    return variants


def _seconds(model, settings: CacheSettings, ids: torch.Tensor) -> float:
    cache = settings.build(model)
    start = time.perf_counter()
    prefill(model, cache, ids)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--text", required=True)
    parser.add_argument("--tokens", default="2048,3600", help="prompt lengths, comma-separated")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--recall", default="0.5")
    parser.add_argument("--rests", default="off,prompt", help="the recall rows' --recall-rest values")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    threads.apply(args.threads)
    loaded = load(args.model, "cpu", args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    text_ids = tokenizer(Path(args.text).read_text(), return_tensors="pt").input_ids
    variants = _variants(args.budget, args.recall, args.rests.split(","))
    report = {"model": args.model, "dtype": args.dtype, "text": Path(args.text).name, "budget": args.budget,
              "recall": args.recall, "threads": args.threads, "repeats": args.repeats, "command": " ".join(sys.argv),
              "lengths": []}
    with torch.inference_mode():
        for tokens in (int(n) for n in args.tokens.split(",")):
            if text_ids.shape[1] < tokens:
                raise SystemExit(f"the text holds {text_ids.shape[1]} tokens, fewer than {tokens}")
            ids = text_ids[:, :tokens]
            _seconds(model, variants["h2o"], ids[:, :600])  # (warm: the first forward's one-time costs)
            times = {name: [] for name in variants}
            names = list(variants)
            for repeat in range(args.repeats):
                for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                    times[name].append(_seconds(model, variants[name], ids))
            medians = {name: statistics.median(values) for name, values in times.items()}
            report["lengths"].append({
                "tokens": tokens, "seconds": times, "median_seconds": medians,
                "over_h2o": {name: medians[name] / medians["h2o"] for name in names},
                "over_rest_off": {name: medians[name] / medians["recall, rest off"] for name in names}
                if "recall, rest off" in medians else None})
    emit(report, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
