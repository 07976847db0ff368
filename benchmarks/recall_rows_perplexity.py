"""The recall rows alone of `h2ochat eval` (perplexity), over the tokens that command reads.

After a change to recall only the recall rows change (the full cache and the policy alone run no
recall code); on a CPU shared by several sessions, running them alone is what fits. The records are
`eval --json`'s own (``evaluation.records``); compare them with the policy alone from an `eval` run
of the same --text, --tokens and --budget.

    python benchmarks/recall_rows_perplexity.py --text /work/shared/data/gfdl-1.3.txt --tokens 1000 \
        --budget 128 --recall 0.5 > rows.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from h2ochat.measure import evaluation as ev
from h2ochat import threads
from h2ochat.loading.models import load
from json_report import emit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", required=True)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--budget", default="128")
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--recall", default="0.5")
    parser.add_argument("--page", default="16")
    parser.add_argument("--selector", default="rot4")
    args = parser.parse_args()

    loaded = load(args.model, "cpu", "float32")
    [ids] = ev.text_windows(loaded.tokenizer, Path(args.text).read_text(), args.tokens, 1)
    budgets = ev.parse_budgets(args.budget, len(ids))
    recalls = ev.recall_settings(args.recall, args.page, selector=args.selector)
    rows = [row for row in ev.build_rows([args.policy], budgets, len(ids), recalls=recalls) if row.recall is not None]
    speed = ev.Speed()
    results = ev.evaluate_rows(loaded.model, ids, rows, speed=speed)
    emit({"model": loaded.name, "text": Path(args.text).name, "tokens": len(ids), "args": vars(args),
                      "threads": threads.current(), "recall": ev.describe_recalls(recalls),
                      "results": ev.records(results, budgets), "seconds": round(speed.seconds, 1)}, None)


if __name__ == "__main__":
    main()
