"""A server's bf16 model decoding one row, eager, in its two packed forms side by side in one process: the packed
weights alone, and the packed weights with the plain ones kept beside them for the row kernel's few-row products
(``h2ochat.engine.packed_linears.keeps_both``, the default where memory allows). Each form has its own copy of the
model and its own H2O cache (budget 0.2) over the same prompt; the forms take turns, the order flipped each round,
wall time per decode step at ``--threads``.

    python benchmarks/packed_few_rows_step.py --out benchmarks/results_packed_few_rows_step.json
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from json_report import emit  # noqa: E402

from h2ochat.engine import packed_linears  # noqa: E402
from h2ochat.engine.generation import CacheSettings, forward, prefill  # noqa: E402
from h2ochat.loading.models import load  # noqa: E402

FORMS = {"packed alone": "0", "packed and plain": "1"}  # H2OCHAT_KEEP_PLAIN_WEIGHTS per form


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--server-rows", type=int, default=26, help="the rows the server packs its model for")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15, help="decode steps per form and round")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = load(args.model, device="cpu", dtype="bfloat16").model
    packed_linears.unpack_linears(base)
    models, forms = {}, {}
    for name, switch in FORMS.items():
        model = copy.deepcopy(base)
        os.environ[packed_linears.KEEP_BOTH_SWITCH] = switch
        packed_linears.pack_linears(model, args.server_rows)
        models[name], forms[name] = model, packed_linears.form_of(model)
    os.environ.pop(packed_linears.KEEP_BOTH_SWITCH)
    total = args.prompt_tokens + args.rounds * args.steps
    ids = torch.randint(0, base.config.vocab_size, (1, total), generator=torch.Generator().manual_seed(0))
    caches, times = {}, {name: [] for name in models}
    with torch.inference_mode():
        for name, model in models.items():
            caches[name] = CacheSettings(budget="0.2").build(model)
            prefill(model, caches[name], ids[:, :args.prompt_tokens], chunk=512)
        at = args.prompt_tokens
        for turn in range(args.rounds):
            for name in (list(models) if turn % 2 == 0 else list(reversed(models))):
                started = time.perf_counter()
                for step in range(args.steps):
                    forward(models[name], caches[name], ids[:, at + step:at + step + 1])
                times[name].append((time.perf_counter() - started) / args.steps * 1e3)
            at += args.steps
    medians = {name: round(statistics.median(t), 2) for name, t in times.items()}
    emit({"model": args.model, "threads": args.threads, "server_rows": args.server_rows,
          "prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "steps": args.steps, "forms": forms,
          "ms_per_step": {name: [round(x, 2) for x in t] for name, t in times.items()},
          "median_ms_per_step": medians,
          "speedup": round(medians["packed alone"] / medians["packed and plain"], 3)}, args.out,
         what="A server's packed bf16 model decoding one row, eager: the packed weights alone against the plain "
              "ones kept beside them for the row kernel, side by side")
    return 0


if __name__ == "__main__":
    sys.exit(main())
