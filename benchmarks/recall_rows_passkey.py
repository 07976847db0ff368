"""The recall rows alone of `h2ochat eval --task passkey`, on the trials that command draws.

On a CPU shared by several sessions a whole pass-key table (full cache, the policy alone, recall
with the default and the exact selector) did not fit in the time left; the full cache and the policy
alone run no recall code, so after a change to recall only these rows need running again. The
trials are those `eval --task passkey` draws for the same --lengths (all of them, in order),
--depths, --keys and --seed; --only keeps the trials of some lengths (their keys unchanged).

    python benchmarks/recall_rows_passkey.py --text /work/shared/data/gfdl-1.3.txt --lengths 880,2000 \
        --only 880 --budget 128 --recall 0.5 --selector rot4,exact > rows.json

--kv-dtype auto,int8 runs each recall row with the model's float slots and with int8 slots;
--cold-dtype auto,int8 each with the cold store at the model's dtype and as int8 codes (issue 34).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from h2ochat.measure import evaluation as ev
from h2ochat.measure import passkey as pk
from h2ochat.measure.passkey_rows import build_rows, parse_numbers
from h2ochat import threads
from h2ochat.loading.models import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", required=True)
    parser.add_argument("--lengths", default="880,2000", help="the lengths eval --task passkey was given")
    parser.add_argument("--only", default="", help="run the trials of these lengths alone (default: all)")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--keys", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--recall", default="0.5")
    parser.add_argument("--page", default="16")
    parser.add_argument("--selector", default="rot4,exact")
    parser.add_argument("--kv-dtype", default="auto", help="slot formats, comma-separated (rows run side by side)")
    parser.add_argument("--cold-dtype", default="auto", help="cold store formats, comma-separated (rows side by side)")
    args = parser.parse_args()

    lengths = parse_numbers(args.lengths, int, "--lengths")
    only = set(parse_numbers(args.only, int, "--only")) if args.only else set(lengths)
    cold_dtypes = args.cold_dtype.split(",")
    kv_dtypes = ev.parse_kv_dtypes(args.kv_dtype)
    rows = []
    for cold_dtype in cold_dtypes:
        recalls = ev.recall_settings(args.recall, args.page, selector=args.selector, cold_dtype=cold_dtype)
        cold = "" if cold_dtype in ("auto", "same") else f" cold {cold_dtype}"
        rows += [replace(row, label=(row.label if kv_dtype == "auto" else f"{row.label} {kv_dtype} slots") + cold)
                 for kv_dtype in kv_dtypes
                 for row in build_rows([args.policy], [args.budget], recalls, settings={"kv_dtype": kv_dtype})
                 if row.settings.recall]
    loaded = load(args.model, "cpu", "float32")
    text = Path(args.text).read_text()
    trials = [t for t in pk.make_trials(loaded.tokenizer, text, lengths, parse_numbers(args.depths, float, "--depths"),
                                        args.keys, seed=args.seed) if t.length in only]

    def progress(record: dict) -> None:
        print(f"{record['row']}, {record['length']} tokens, depth {record['depth']:g}: "
              f"{'recalled' if record['recalled'] else 'missed'}", file=sys.stderr, flush=True)

    results = pk.run(loaded.model, loaded.tokenizer, trials, rows, on_trial=progress)
    print(json.dumps({"model": loaded.name, "text": Path(args.text).name, "args": vars(args), "threads": threads.current(),
                      "recall": ev.describe_recalls(recalls), "results": results, "summary": pk.summarize(results)},
                     indent=1))


if __name__ == "__main__":
    main()
