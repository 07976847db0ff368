"""The recall rows alone of `h2ochat eval --task passkey`, on the trials that command draws.

On a CPU shared by several sessions a whole pass-key table (full cache, the policy alone, recall
with the default and the exact selector) did not fit in the time left; the full cache and the policy
alone run no recall code, so after a change to recall only these rows need running again. The
trials are those `eval --task passkey` draws for the same --lengths (all of them, in order),
--depths, --keys and --seed; --only keeps the trials of some lengths (their keys unchanged).

    python benchmarks/recall_rows_passkey.py --text /work/shared/data/gfdl-1.3.txt --lengths 880,2000 \
        --only 880 --budget 128 --recall 0.5 --selector rot4,exact > rows.json

--kv-dtype auto,int8 runs each recall row with the model's float slots and with int8 slots;
--cold-dtype auto,int8 each with the cold store at the model's dtype and as int8 codes, --recall-every 1,16
each choosing its pages every step and every 16th (issue 34). --question-chunk 512 feeds the recall rows'
question as one prompt chunk, as a served chat's turn comes (its queries choose pages before the answer), where
the default 1 feeds it token by token (each token choosing for itself: the harder case).

Held-out texts (issue 34): --text takes comma-separated files (each its own trials, drawn as above),
--masked plain|rest runs the recall rows through the masked reference instead (``recall.masked``; rest:
the cold pages not recalled attended as one column each, their exact weight and mean value),
--rows all adds the full cache and the policy alone at the same device slots beside the recall rows
(--rows baselines runs those two without the recall rows),
and --out FILE appends each trial to a JSON-lines file as it ends and skips the trials already there
(a run stopped on a shared CPU resumes where it was). The report gives each row's hits over all
texts with a 95% Wilson interval (``passkey.row_totals``):

    python benchmarks/heldout_texts.py /tmp/heldout
    nice -n 5 python benchmarks/recall_rows_passkey.py --text /tmp/heldout/gpl3.txt,... --lengths 900 \
        --depths 0.1,0.5,0.9 --keys 5 --budget 128 --recall 0.5 --selector rot4 --rows all \
        --out trials.jsonl > report.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

from h2ochat.measure import evaluation as ev
from h2ochat.measure import passkey as pk
from h2ochat.measure.passkey_rows import build_rows, parse_numbers
from h2ochat.recall.tiered import DECODE_RULES
from h2ochat import threads
from h2ochat.loading.models import load
from json_report import emit


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
    parser.add_argument("--recall-every", default="1",
                        help="decode steps per choice of pages, comma-separated (rows side by side; 1 is run's default)")
    parser.add_argument("--question-chunk", type=int, default=1,
                        help="the recall rows' question fed in chunks of this many tokens (1: token by token, each "
                             "token choosing its pages; a chat's turn comes as one prompt: 512, the prefill chunk)")
    parser.add_argument("--decode-rule", choices=DECODE_RULES, default=DECODE_RULES[0],
                        help="before: the recall rows' decode steps choose their pages before the step with the last "
                             "step's queries, as a GPU's compiled step does (in-step: with their own queries, the "
                             "eager step's rule and a CPU's compiled step's)")
    parser.add_argument("--recall-rest", default="off", help="the recall rows' --recall-rest (auto, off, pages or prompt)")
    parser.add_argument("--dtype", default="float32",
                        help="the model's dtype (float32, as every stored row so far; bfloat16: the CPU's product "
                             "dtype, where the decode step's C call runs, and with it --recall-rest auto's rest)")
    parser.add_argument("--masked", choices=("off", "plain", "rest"), default="off",
                        help="the recall rows through the masked reference (recall.masked, fp32, staged as the real "
                             "tier stages) instead of the cache: plain, or with the rest (the cold pages not recalled "
                             "attended as one column each)")
    parser.add_argument("--rows", choices=("recall", "all", "baselines"), default="recall",
                        help="all: the full cache and the policy alone too; baselines: those two alone")
    parser.add_argument("--out", default="", help="JSON lines, one per trial: appended, and trials there are skipped")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    args = parser.parse_args()
    if args.threads:
        threads.apply(args.threads)

    lengths = parse_numbers(args.lengths, int, "--lengths")
    only = set(parse_numbers(args.only, int, "--only")) if args.only else set(lengths)
    cold_dtypes = args.cold_dtype.split(",")
    kv_dtypes = ev.parse_kv_dtypes(args.kv_dtype)
    everys = parse_numbers(args.recall_every, int, "--recall-every")
    rows = []
    for cold_dtype in cold_dtypes:
        for every in everys:
            recalls = ev.recall_settings(args.recall, args.page, selector=args.selector, cold_dtype=cold_dtype,
                                         recall_every=every, recall_rest=args.recall_rest)
            tag = ("" if cold_dtype in ("auto", "same") else f" cold {cold_dtype}") + ("" if every == 1 else f" every {every}")
            tag += "" if args.question_chunk == 1 else f" question in chunks of {args.question_chunk}"
            tag += " pages chosen before each decode step" if args.decode_rule == "before" else ""
            first = kv_dtypes[0], cold_dtypes[0], everys[0]
            rows += [replace(row, label=(row.label if kv_dtype == "auto" else f"{row.label} {kv_dtype} slots") + tag,
                             settings=replace(row.settings, recall_decode_rule=args.decode_rule),
                             static_shapes=args.decode_rule == "before" and bool(row.settings.recall))
                     for kv_dtype in kv_dtypes
                     for row in build_rows((["full"] if args.rows != "recall" else []) + [args.policy], [args.budget],
                                           recalls, settings={"kv_dtype": kv_dtype},
                                           recall_chunk=args.question_chunk)
                     if (row.settings.recall and args.rows != "baselines")
                     or (not row.settings.recall and args.rows != "recall" and (kv_dtype, cold_dtype, every) == first)]
    if args.masked != "off":
        rows = [row for row in rows if not row.settings.recall] + masked_rows(args, recalls)
    loaded = load(args.model, "cpu", args.dtype)
    out = Path(args.out) if args.out else None
    done = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out and out.exists() else []
    seen = {(r["text"], r["row"], r["length"], r["depth"], r["window"]) for r in done}
    results, texts, drawn = list(done), [], []
    for path in [Path(part) for part in args.text.split(",") if part.strip()]:
        content = path.read_text()
        texts.append({"file": path.name, "sha256": hashlib.sha256(content.encode()).hexdigest()})
        drawn += [(path.name, t) for t in pk.make_trials(loaded.tokenizer, content, lengths,
                                                          parse_numbers(args.depths, float, "--depths"), args.keys,
                                                          seed=args.seed) if t.length in only]
    # key by key over every text and depth (each row in turn): a run stopped early holds a balanced share
    drawn.sort(key=lambda pair: pair[1].window)
    for name, trial in drawn:
        def progress(record: dict, name=name) -> None:
            record["text"] = name
            results.append(record)
            if out is not None:
                with out.open("a") as sink:
                    sink.write(json.dumps(record) + "\n")
            print(f"{name}: {record['row']}, {record['length']} tokens, depth {record['depth']:g}: "
                  f"{'recalled' if record['recalled'] else 'missed'}", file=sys.stderr, flush=True)

        pk.run(loaded.model, loaded.tokenizer, [trial], rows, on_trial=progress,
               wanted=lambda row, t, name=name: (name, row.label, t.length, t.depth, t.window) not in seen)
    emit({"model": loaded.name, "texts": texts, "args": vars(args), "threads": threads.current(),
                      "recall": ev.describe_recalls(recalls), "totals": pk.row_totals(results),
                      "summary": pk.summarize(results), "results": results}, None)


def masked_rows(args, recalls) -> list:
    """The masked reference's rows for the last recall settings (``--masked``), staged as the real tier
    stages, with the rest attended where asked."""
    rest = args.masked == "rest"
    built = build_rows([args.policy], [args.budget], recalls, masked=True, recall_chunk=args.question_chunk)
    return [replace(row, staged=True, rest=rest, label=row.label + (", the rest attended" if rest else ""))
            for row in built if isinstance(row, pk.MaskedRow)]


if __name__ == "__main__":
    main()
