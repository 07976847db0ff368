"""`h2ochat eval --task passkey`: a key planted in filler text, asked for at the end, per cache row."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .. import evaluation as ev
from .. import passkey as pk
from ..generation import max_positions
from ..models import load
from ..recall.selectors import get_selector


def passkey_task(*, text: Path, model: str, device: str, dtype: str, budget: str, policies: str, lengths: str,
                 depths: str, keys: int, facts: int, recall: str, page: int, selector: str, seed: int, as_json: bool) -> None:
    if facts not in (1, 2):
        raise ValueError(f"--facts must be 1 or 2, got {facts}")
    names = ev.parse_policies(policies)
    length_list = pk.parse_numbers(lengths, int, "--lengths")
    depth_list = pk.parse_numbers(depths, float, "--depths")
    recalls = [part.strip() for part in recall.split(",") if part.strip()]
    get_selector(selector)
    budgets = ev.parse_budgets(budget, min(length_list))
    rows = pk.build_rows(names, budgets, recalls, page=page, selector=selector)  # bad settings fail before loading
    content = Path(text).read_text(encoding="utf-8")
    err = Console(stderr=True)
    with err.status(f"loading {model}", spinner="dots") if err.is_terminal else nullcontext():
        loaded = load(model, device, dtype)
    trials = pk.make_trials(loaded.tokenizer, content, length_list, depth_list, keys, seed=seed, facts=facts)
    longest = max(t.context.shape[1] + sum(q.shape[1] + pk.ANSWER_TOKENS for q in [t.question] + [q for _, q in t.more])
                  for t in trials)
    if longest > max_positions(loaded.model.config):
        raise ValueError(f"{longest} tokens pass the model's {max_positions(loaded.model.config)}-position limit: "
                         "use shorter --lengths")
    done = [0]

    def progress(result: dict) -> None:
        done[0] += 1
        err.print(f"passkey {done[0]}/{len(rows) * len(trials)}: {result['row']}, {result['length']} tokens, "
                  f"depth {result['depth']:g}: {'recalled' if result['recalled'] else 'missed'} ({result['answer'].strip()!r})")

    results = pk.run(loaded.model, loaded.tokenizer, trials, rows, on_trial=progress)
    summary = pk.summarize(results)
    report = {"task": "passkey", "model": loaded.name, "text": Path(text).name, "lengths": length_list,
              "depths": depth_list, "keys": keys, "facts": facts, "budgets": budgets, "seed": seed, "results": results,
              "summary": summary}
    if recalls:
        report["recall"] = {"selector": selector, "page": page, "question": "token by token"}
    if as_json:
        print(json.dumps(report, indent=2))
        return
    titles, cells = pk.table_rows(summary)
    table = Table(title=f"Pass key recalled / trials ({loaded.name}, filler {Path(text).name})", title_justify="left")
    for title in titles:
        table.add_column(title, justify="left" if title == "cache" else "right")
    for row in cells:
        table.add_row(*row)
    Console().print(table)
