"""`h2ochat eval --task passkey`: a key planted in filler text, asked for at the end, per cache row."""

from __future__ import annotations

import json
from pathlib import Path

from ..measure import evaluation as ev
from ..measure import passkey as pk
from ..measure.passkey_rows import build_rows, parse_numbers, table_rows
from ..measure import passkey_chat as chat
from ..measure import passkey_probes as probes
from .. import threads
from ..errors import UserError, one_line, user_input
from ..engine.generation import max_positions
from ..loading.models import load
from ..chat.prompting import read_text_file
from ..console import print_table
from .common import loading


def passkey_task(*, text: Path, model: str, device: str, dtype: str, budget: str, policies: str, lengths: str,
                 depths: str, keys: int, facts: int, recalls: list, seed: int, as_json: bool, chat_turns: int = 0,
                 plot: Path | None = None, kv_dtypes: tuple[str, ...] = ("auto",)) -> None:
    """``recalls``: the recall settings (``evaluation.recall_settings``), one recall row each beside
    every evicting policy and budget. ``lengths``: token counts or multiples of the device slots
    (``passkey_probes.LengthPlan``). ``chat_turns`` >= 3: the chat variant (``passkey_chat``)."""
    with user_input():  # the options as typed
        if facts not in (1, 2):
            raise ValueError(f"--facts must be 1 or 2, got {facts}")
        if chat_turns and (chat_turns < 3 or facts != 1):
            raise ValueError(f"--chat-turns needs at least 3 turns (the key, filler, the question) and one fact, "
                             f"got {chat_turns} turns and --facts {facts}")
        names = ev.parse_policies(policies)
        specs = probes.parse_lengths(lengths)
        depth_list = [0.0] if chat_turns else parse_numbers(depths, float, "--depths")
        budgets = probes.budgets_for(budget, specs, ev.parse_budgets)
        plan = probes.LengthPlan(specs, budgets)
        length_list = plan.lengths()
        rows = build_rows(names, budgets, recalls, kv_dtypes=kv_dtypes)  # bad settings fail before loading
    content = read_text_file(text)
    from ..console import make_console  # reads no markup: a label such as h2o [int8] prints as it is
    err = make_console(stderr=True)
    with loading(err, model):
        loaded = load(model, device, dtype)
    with user_input():  # the filler and the lengths against this model
        if chat_turns:
            trials = chat.make_chat_trials(loaded.tokenizer, content, length_list, chat_turns, keys, seed=seed)
            longest = max(trial.tokens_upper_bound for trial in trials)
        else:
            trials = pk.make_trials(loaded.tokenizer, content, length_list, depth_list, keys, seed=seed, facts=facts)
            longest = max(t.context.shape[1] + sum(q.shape[1] + pk.ANSWER_TOKENS
                                                   for q in [t.question] + [q for _, q in t.more]) for t in trials)
        if longest > max_positions(loaded.model.config):
            raise ValueError(f"{longest} tokens pass the model's {max_positions(loaded.model.config)}-position limit: "
                             "use shorter --lengths")
    done = [0]
    total = sum(plan.wanted(row, trial) for row in rows for trial in trials)

    def progress(result: dict) -> None:
        done[0] += 1
        share = result.get("exact_top_pages_found")
        err.print(f"passkey {done[0]}/{total}: {result['row']}, {result['length']} tokens"
                  + (f" ({result['slots_ratio']:g}x its slots)" if result.get("slots_ratio") else "") + ", "
                  f"depth {result['depth']:g}: {'recalled' if result['recalled'] else 'missed'} ({result['answer'].strip()!r})"
                  + (f", exact top pages found {share:.3f}" if share is not None else ""))

    if chat_turns:
        results = chat.run_chats(loaded.model, loaded.tokenizer, trials, rows, on_trial=progress, wanted=plan.wanted)
    else:
        results = pk.run(loaded.model, loaded.tokenizer, trials, rows, on_trial=progress, wanted=plan.wanted)
    results = probes.attribute(results, rows)
    summary = pk.summarize(results)
    report = {"task": "passkey", "model": loaded.name, "text": Path(text).name, "lengths": length_list,
              "length_plan": plan.describe(), "misses": probes.miss_counts(results),
              "depths": depth_list, "keys": keys, "facts": facts, "budgets": budgets, "seed": seed,
              "threads": threads.current(), "results": results, "summary": summary}
    if chat_turns:
        report["chat"] = chat.describe(chat_turns)
    if recalls:
        report["recall"] = ev.describe_recalls(recalls)
        if not chat_turns:
            report["question"] = "token by token on the recall rows"
    plot_failed = None
    if plot is not None:
        from ..measure.plotting import passkey_plot

        try:
            passkey_plot(summary, plot, title=f"pass key, {loaded.name}, filler {Path(text).name}")
            err.print(f"plot written to {plot}")
        except OSError as exc:  # checked before the model loaded, so rare: the results still print below
            plot_failed = exc
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        titles, cells = table_rows(summary, (lambda length, _: f"{plan.length_title(length)} over {chat_turns} turns") if chat_turns else plan.title)
        titles, cells = probes.with_misses(titles, cells, probes.miss_counts(results))
        what = f"a {chat_turns}-turn chat, the key in turn 1" if chat_turns else "the key planted in the filler"
        print_table(f"Pass key recalled / trials ({loaded.name}, filler {Path(text).name}, {what})", titles, cells)
    if plot_failed is not None:
        raise UserError(f"could not write the plot {plot}: {one_line(plot_failed)} (the results are above)")
