"""Measure recall selectors on SmolLM2-135M with the masked reference simulation (h2ochat.recall.masked).

For each row: pass-key recall over the trials, and the share of the exact selector's top pages the
row's selector found (per layer, averaged over steps and trials). Writes JSON as it goes.

    OMP_NUM_THREADS=1 python benchmarks/recall_selectors.py --length 880 --slots 128 --out benchmarks/results_recall_selectors_880.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from h2ochat.measure import passkey as pk
from h2ochat.engine.generation import CacheSettings
from h2ochat.loading.models import load
from h2ochat.recall.selectors import get_selector
from json_report import write


def rows_for(slots: int, page: int, selectors: list[str]) -> list:
    hot = recall = slots // 2
    rows = [pk.CacheRow("full", CacheSettings(policy="full", budget=str(slots))),
            pk.CacheRow(f"h2o {slots}", CacheSettings(policy="h2o", budget=str(slots))),
            pk.CacheRow(f"h2o {hot} (the hot slots alone)", CacheSettings(policy="h2o", budget=str(hot)))]
    for name in selectors:
        rows.append(pk.MaskedRow(f"{name} p{page} q1", "h2o", hot, recall, page, name, question_chunk=1))
    rows += [pk.MaskedRow(f"exact p{page} qchunk", "h2o", hot, recall, page, "exact"),
             pk.MaskedRow(f"exact p1 qchunk", "h2o", hot, recall, 1, "exact"),
             pk.MaskedRow(f"exact p{page} qchunk-last", "h2o", hot, recall, page, "exact", chunk_queries="last"),
             pk.MaskedRow(f"exact p{page} q1 by-eviction", "h2o", hot, recall, page, "exact", "eviction", question_chunk=1),
             pk.MaskedRow(f"exact p{page} q1 reenter", "h2o", hot, recall, page, "exact", reenter=True, question_chunk=1),
             pk.MaskedRow(f"exact p8 q1", "h2o", hot, recall, 8, "exact", question_chunk=1),
             pk.MaskedRow(f"exact p32 q1", "h2o", hot, recall, 32, "exact", question_chunk=1),
             pk.MaskedRow(f"quest p8 q1", "h2o", hot, recall, 8, "quest", question_chunk=1),
             pk.MaskedRow(f"exact p{page} q1 mean", "mean", hot, recall, page, "exact", question_chunk=1)]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=880)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--depths", default="0.1,0.9")
    parser.add_argument("--keys", type=int, default=3)
    parser.add_argument("--text", default="/work/shared/data/gfdl-1.3.txt")
    parser.add_argument("--selectors", default="exact,quest,quest4,quest2,int1,int2,int4,reps2,reps4")
    parser.add_argument("--rows", default="", help="only rows whose label contains one of these (comma-separated)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load("smollm2-135m", "cpu", "float32")
    text = open(args.text, encoding="utf-8").read()
    trials = pk.make_trials(loaded.tokenizer, text, [args.length], [float(d) for d in args.depths.split(",")], args.keys)
    rows = rows_for(args.slots, args.page, args.selectors.split(","))
    if args.rows:
        wanted = args.rows.split(",")
        rows = [r for r in rows if any(w in r.label for w in wanted)]
    report = {"command": "OMP_NUM_THREADS=1 python " + " ".join(sys.argv), "model": loaded.name,
              "text": args.text.rsplit("/", 1)[-1], "length": args.length, "slots": args.slots,
              "context_tokens": [int(t.context.shape[1]) for t in trials], "rows": []}
    head_dim = loaded.model.config.hidden_size // loaded.model.config.num_attention_heads
    for row in rows:
        started = time.perf_counter()
        results = pk.run(loaded.model, loaded.tokenizer, trials, [row])
        entry = {"row": row.label, "recalled": sum(r["recalled"] for r in results), "trials": len(results),
                 "by_depth": pk.summarize(results), "answers": [r["answer"] for r in results],
                 "seconds": round(time.perf_counter() - started, 1)}
        if isinstance(row, pk.MaskedRow):
            layers = [s.stats.per_layer() for s in row.simulations]
            per_layer = []
            for layer in range(len(layers[0])):
                values = [x[layer] for x in layers if x[layer] is not None]
                per_layer.append(round(sum(values) / len(values), 3) if values else None)
            known = [x for x in per_layer if x is not None]
            entry.update(selector=row.selector, page=row.page, hot_slots=row.hot_slots, recall_slots=row.recall_slots,
                         grouping=row.grouping, reenter=row.reenter, question_chunk=row.question_chunk,
                         chunk_queries=row.chunk_queries,
                         exact_top_pages_found=round(sum(known) / len(known), 3) if known else None,
                         exact_top_pages_found_per_layer=per_layer,
                         selector_bytes_ratio=round(get_selector(row.selector).bytes_ratio(row.page, head_dim), 4))
            row.simulations.clear()
        report["rows"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k not in ("by_depth", "exact_top_pages_found_per_layer")}),
              flush=True)
        write(report, args.out)  # after every row: a long run keeps what it measured


if __name__ == "__main__":
    main()
