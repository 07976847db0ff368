"""The RULER table of a log that is still growing: every row's score per task on the samples that every
row has finished, with Wilson 95% intervals, as JSON (and a table on standard error).

A log can hold lines of samples whose prompt has changed since (a builder's fix): only lines whose digest
is that of the sample the current code builds count, as they do for ``h2ochat eval``'s resume.

    python benchmarks/ruler_summary.py benchmarks/ruler_smollm2_1024.jsonl --model smollm2-135m \
        --dtype float32 --length 1024 --samples 25 > benchmarks/ruler_smollm2_1024_summary.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from h2ochat.measure import ruler, score_table  # noqa: E402
from h2ochat.measure.eval_log import fingerprint  # noqa: E402
from json_report import emit  # noqa: E402


def current_digests(model: str, dtype: str, length: int, samples: int, seed: int) -> dict[tuple, str]:
    """(task, sample id) -> the digest ``eval --task ruler`` gives that sample today."""
    from h2ochat.loading.models import load

    loaded = load(model, "cpu", dtype)
    weights = str(next(loaded.model.parameters()).dtype)
    return {(s.task, s.index): fingerprint((s, loaded.name, weights))
            for task in ruler.TASKS for s in ruler.build_samples(loaded.tokenizer, task, length, samples, seed)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=25, help="sample ids 0..N-1 considered")
    parser.add_argument("--seed", type=int, default=0, help="eval's --seed (its default: 0)")
    args = parser.parse_args(argv)

    digests = current_digests(args.model, args.dtype, args.length, args.samples, args.seed)
    records = [json.loads(line) for line in args.log.read_text(encoding="utf-8").splitlines() if line.strip()]
    current = [r for r in records if r.get("length") == args.length
               and digests.get((r["task"], r["sample"])) == r["digest"]]
    rows = list(dict.fromkeys(r["cache"] for r in current))
    done: dict[tuple, set] = {}
    for r in current:
        done.setdefault((r["task"], r["sample"]), set()).add(r["cache"])
    common = {key for key, caches in done.items() if len(caches) == len(rows)}
    kept = [r for r in current if (r["task"], r["sample"]) in common]
    summary = score_table.summarize(kept)
    per_task = {task: sum(1 for t, _ in common if t == task) for task in ruler.TASKS}
    titles, table = score_table.table_cells(summary)
    print("\t".join(titles), file=sys.stderr)
    for row in table:
        print("\t".join(row), file=sys.stderr)
    emit({"log": str(args.log), "model": args.model, "dtype": args.dtype, "length": args.length,
               "rows": rows, "samples_every_row_has": per_task, "stale_lines_left_out": len(records) - len(current),
               "summary": summary}, None)


if __name__ == "__main__":
    main()
