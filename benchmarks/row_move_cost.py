"""What a server's row move costs (``H2OCache.move_row``: a running row packed to the front), against a copy of
the row out into host memory and back (``export_row`` then ``import_row``, how a move was made before session
67), in turns in one process: a real text prefilled into a 1-row cache, imported into row 5 of an 8-row cache,
then moved between rows 5 and 2. Medians of ``--repeats`` moves each.

    taskset -c 1 python benchmarks/row_move_cost.py --text /tmp/heldout/gpl3.txt --tokens 1300 --budget 256 \\
        --recall 0.5
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from h2ochat import threads
from h2ochat.engine.generation import CacheSettings, prefill
from h2ochat.loading.models import load
from json_report import emit


def _copied_out_and_back(cache, source: int, target: int) -> None:
    cache.import_row(target, cache.export_row(source, device="cpu"), moved_from=source)
    cache.reset_row(source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--text", required=True)
    parser.add_argument("--tokens", type=int, default=1300)
    parser.add_argument("--budget", default="256")
    parser.add_argument("--recall", default="0.5")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    threads.apply(1)
    loaded = load(args.model, "cpu", args.dtype)
    model, config = loaded.model, loaded.model.config
    ids = loaded.tokenizer(Path(args.text).read_text(), return_tensors="pt").input_ids[:, :args.tokens]
    settings = CacheSettings(policy="h2o", budget=args.budget, recall=args.recall)
    ways = {"move_row": lambda cache, source, target: cache.move_row(source, target),
            "copied out and back": _copied_out_and_back}
    with torch.inference_mode():
        alone = settings.build(model)
        prefill(model, alone, ids)
        rows = settings.build(model)
        rows.allocate(8, config.num_key_value_heads, config.hidden_size // config.num_attention_heads,
                      dtype=next(model.parameters()).dtype, device="cpu")
        rows.import_row(5, alone.export_row(0))
        seconds = {name: [] for name in ways}
        source, target = 5, 2
        for _ in range(args.repeats):
            for name, way in ways.items():
                start = time.perf_counter()
                way(rows, source, target)
                seconds[name].append(time.perf_counter() - start)
                source, target = target, source
    emit({"args": vars(args), "median_ms": {name: round(statistics.median(v) * 1e3, 2)
                                            for name, v in seconds.items()}}, None)


if __name__ == "__main__":
    main()
