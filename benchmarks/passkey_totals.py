"""Totals of pass-key trials from the JSON-lines files ``recall_rows_passkey.py --out`` writes: one draw run as
several processes (a few texts each, side by side on the cores), or several draws, counted as one.

    python benchmarks/passkey_totals.py A.jsonl B.jsonl --out MERGED.json

Prints each row's hits, trials, rate and 95% interval (Wilson); ``--out`` writes them with the per-depth summary
and every trial.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from h2ochat.measure import passkey as pk
from json_report import write


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trials", nargs="+", help="JSON-lines files of trials")
    parser.add_argument("--out", default="", help="the merged report (JSON)")
    args = parser.parse_args(argv)
    results = [json.loads(line) for name in args.trials for line in Path(name).read_text().splitlines() if line.strip()]
    report = {"trials_from": [Path(name).name for name in args.trials], "totals": pk.row_totals(results),
              "summary": pk.summarize(results), "results": results}
    if args.out:
        write(report, args.out)
    print(json.dumps(report["totals"], indent=1))
    return report


if __name__ == "__main__":
    main()
