"""`h2ochat eval`: perplexity of a text through every policy's cache at several budgets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .. import options as o
from ..errors import UserError, one_line, strict_user_errors, user_input
from ..chat.history import refuse_replacing
from ..measure.plotting import check_plot_path
from .common import constant_of, loading

# the measuring module imports torch: its defaults are read from its source (--help stays fast), the
# module itself is imported when the command runs
EVALUATION = "measure.evaluation"
TASKS = ("perplexity", "passkey", "ruler", "chat-memory")


@strict_user_errors
def eval_command(
    text: Annotated[Optional[Path], typer.Option("--text", "-f", rich_help_panel=o.OUTPUT,
        help="Plain-text file to continue token by token (only its first --tokens tokens are read); "
             "not read by --task ruler or chat-memory.")] = None,
    model: o.Model = o.DEFAULTS["model"],
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    tokens: Annotated[int, typer.Option("--tokens", min=2, rich_help_panel=o.CACHE,
        help="Tokens of the text to evaluate (no BOS added).")] = 2000,
    budget: Annotated[str, typer.Option("--budget", "-b", rich_help_panel=o.CACHE,
        help="Comma-separated budgets, a row each. Each: " + o.budget_help("the text measured", fits_at="each --kv-dtype")
             + " The text measured: --tokens (perplexity), the shortest of --lengths (passkey), each of --lengths "
               "(ruler); run, generate, story and serve take a share of the context window instead.")
        ] = constant_of(EVALUATION, "DEFAULT_BUDGETS"),
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", rich_help_panel=o.CACHE,
        help=o.listed(o.KvDtype, "Comma-separated slot dtypes, a row of each policy and budget for each, side by side; "
                                 "the full cache runs at the first."))] = "auto",
    policies: Annotated[str, typer.Option("--policies", rich_help_panel=o.CACHE,
        help=o.listed(o.Policy, "Comma-separated policies to compare, a row each, e.g. full,h2o,decay:decay=0.95 "
                                "(knobs: decay, heavy_ratio, sinks, value_eps, layer_shape)."))
        ] = ",".join(constant_of(EVALUATION, "DEFAULT_POLICIES")),
    heavy_ratio: o.HeavyRatio = None,
    sinks: o.Sinks = None,
    decay: o.Decay = None,
    windows: Annotated[int, typer.Option("--windows", min=1, rich_help_panel=o.CACHE,
        help="Evaluate this many windows of --tokens tokens spread evenly over the text (the first at its start) "
             "and report the mean and spread of each ratio to the full cache.")] = 1,
    seed: Annotated[int, typer.Option("--seed", rich_help_panel=o.CACHE, help="Seed of the random policy.")] = 0,
    max_rows: Annotated[int, typer.Option("--max-rows", min=1, rich_help_panel=o.CACHE,
        help="(policy, budget) rows run as one batch; more run as further batches.")] = constant_of(EVALUATION, "MAX_ROWS"),
    as_json: o.Json = False,
    task: Annotated[str, typer.Option("--task", rich_help_panel=o.OUTPUT,
        help=" | ".join(TASKS) + ". perplexity: continue --text token by token; passkey: plant a 5-digit key in --text and ask for it "
             "(see --lengths, --depths, --keys, --recall); ruler: lm-eval's offline RULER tasks at --lengths "
             "(needs the eval extra); chat-memory: facts planted in a chat, asked for --turns later.")] = "perplexity",
    samples: Annotated[int, typer.Option("--samples", rich_help_panel=o.CACHE,
        help="ruler, chat-memory: samples per task and length (per depth).")] = 25,
    ruler_tasks: Annotated[str, typer.Option("--ruler-tasks", rich_help_panel=o.CACHE,
        help="ruler: comma-separated tasks, some of " + ", ".join(constant_of("measure.ruler", "TASKS")) + ".")
        ] = ",".join(constant_of("measure.ruler", "TASKS")),
    turns: Annotated[str, typer.Option("--turns", rich_help_panel=o.CACHE,
        help="chat-memory: comma-separated filler turns between the facts and the questions.")] = "0,4,8",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", rich_help_panel=o.OUTPUT,
        help="ruler, chat-memory: JSON-lines log of the finished samples; a run given the same log skips them.")
        ] = None,
    lengths: Annotated[str, typer.Option("--lengths", rich_help_panel=o.CACHE,
        help="passkey: comma-separated filler lengths: tokens (880) or multiples of each budget's device slots "
             "(7x,16x: 896 and 2048 tokens at --budget 128; the full cache runs every length).")] = "880",
    depths: Annotated[str, typer.Option("--depths", rich_help_panel=o.CACHE,
        help="passkey: comma-separated depths of the key in the filler (0 = start, 1 = end).")] = "0.1,0.5,0.9",
    keys: Annotated[int, typer.Option("--keys", min=1, rich_help_panel=o.CACHE,
        help="passkey: trials per (length, depth), each its own key and stretch of the filler.")] = 3,
    facts: Annotated[int, typer.Option("--facts", rich_help_panel=o.CACHE,
        help="passkey: 2 plants a first and a second key (at depth 1 - d) and asks for both in order.")] = 1,
    recall: Annotated[str, typer.Option("--recall", rich_help_panel=o.CACHE,
        help="Comma-separated recall slots of each budget (64, or a share of it: 0.5): adds, beside each evicting "
             "policy, a row of the same policy and budget with that many of its slots holding evicted tokens "
             "recalled from a cold store (the two-tier cache).")] = "",
    page: Annotated[str, typer.Option("--page", rich_help_panel=o.CACHE,
        help=o.listed(o.Page, "Comma-separated page sizes, a recall row for each."))] = str(o.DEFAULTS["page"]),
    selector: o.Selector = o.DEFAULTS["selector"],
    cold_dtype: o.ColdDtype = o.DEFAULTS["cold_dtype"],
    cold_limit: o.ColdLimit = None,
    recall_every: o.RecallEvery = o.DEFAULTS["recall_every"],
    recall_rest: o.RecallRest = o.DEFAULTS["recall_rest"],
    chat_turns: Annotated[int, typer.Option("--chat-turns", rich_help_panel=o.CACHE,
        help="passkey: 0 plants the key in one text; N >= 3 runs a chat of N turns through the chat path: "
             "turn 1 states the key, turns 2..N-1 are filler (--lengths tokens in all) with short replies, "
             "turn N asks for it.")] = 0,
    plot: Annotated[Optional[Path], typer.Option("--plot", rich_help_panel=o.OUTPUT,
        help="Write a PNG: perplexity against budget, one line per policy (--task passkey: the share of "
             "trials recalled per length and depth, one bar per cache row). An existing file is refused unless "
             "--force is given; its folder must exist.")] = None,
    force: Annotated[bool, typer.Option("--force", rich_help_panel=o.OUTPUT,
        help="Let --plot replace a file that exists.")] = False,
):
    """Perplexity of a text continued token by token through each policy's cache, for each budget
    (--task passkey: whether each cache gives back a key planted in the text)."""
    from ..measure import evaluation as ev

    with user_input():  # the options as typed
        if task not in TASKS:
            raise ValueError(f"--task must be {', '.join(TASKS[:-1])} or {TASKS[-1]}, got {task!r}")
        if text is None and task in ("perplexity", "passkey"):
            raise ValueError(f"--task {task} needs --text (a plain-text file)")
        recalls = ev.recall_settings(recall, page, selector=selector, cold_dtype=cold_dtype, cold_limit=cold_limit,
                                     recall_every=recall_every, recall_rest=recall_rest)
        if plot is not None:
            check_plot_path(plot)  # before the model loads: a run must not end on a bad path
            if not plot.parent.is_dir():  # (a typo must not make folders)
                raise ValueError(f"--plot {plot}: the folder {plot.parent} does not exist (make it first)")
        kv_dtypes = ev.parse_kv_dtypes(kv_dtype)
        if output is not None and not output.parent.is_dir():  # (a typo must not make folders)
            raise ValueError(f"--output {output}: the folder {output.parent} does not exist (make it first)")
    if plot is not None and not force:
        refuse_replacing(plot, "--force replaces it, or give another --plot")
    if task in ("ruler", "chat-memory"):
        from .ruler_task import sample_task

        return sample_task(task=task, model=model, device=device, dtype=dtype, budget=budget, policies=policies,
                           lengths=lengths, ruler_tasks=ruler_tasks, turns=turns, samples=samples, recalls=recalls,
                           kv_dtypes=tuple(kv_dtypes), output=output, seed=seed, as_json=as_json, plot=plot)
    if task == "passkey":
        from .passkey_task import passkey_task

        return passkey_task(text=text, model=model, device=device, dtype=dtype, budget=budget, policies=policies,
                            lengths=lengths, depths=depths, keys=keys, facts=facts, recalls=recalls, seed=seed,
                            chat_turns=chat_turns, as_json=as_json, plot=plot, kv_dtypes=tuple(kv_dtypes))
    with user_input():
        if chat_turns:
            raise ValueError("--chat-turns is for --task passkey")
        names = ev.parse_policies(policies)
        ev.build_rows(names, ev.parse_budgets(budget, tokens), tokens, recalls=recalls, heavy_ratio=heavy_ratio,
                      sinks=sinks, decay=decay)  # bad syntax, knobs or recall settings fail before the model loads
    from .. import threads
    from ..engine.generation import max_positions
    from ..loading.models import load
    from ..chat.prompting import read_text_file
    from ..engine.packed_linears import pack_linears

    content = read_text_file(text)
    from ..console import make_console  # reads no markup: a label such as h2o [int8] prints as it is
    err = make_console(stderr=True)
    with loading(err, model):
        loaded = load(model, device, dtype)
    with user_input():  # the text and the budgets against this model
        stretches = ev.text_windows(loaded.tokenizer, content, tokens, windows)
        count = len(stretches[0])
        # a size of --budget is as many slots as fit at each --kv-dtype
        dtype_budgets = {name: ev.parse_budgets(budget, count, ev.size_slots(loaded.model, name)) for name in kv_dtypes}
        budgets = sorted({slots for per_dtype in dtype_budgets.values() for slots in per_dtype})
        ev.check_inputs(count, budgets, max_positions(loaded.model.config))
        rows = [row for window in range(windows) for index, (name, per_dtype) in enumerate(dtype_budgets.items())
                for row in ev.build_rows(names, per_dtype, count, heavy_ratio=heavy_ratio, sinks=sinks, decay=decay,
                                         seed=seed, window=window, recalls=recalls, kv_dtype=name, full=index == 0)]
    pack_linears(loaded.model, min(len(rows), max_rows))  # the linears' form for the rows a step runs

    speed = ev.Speed()
    batches = len(ev.batches(rows, max_rows))
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as progress:
        task = progress.add_task(f"{len(rows)} rows x {count} tokens", total=batches * (count - 1), rate="")

        total_steps = batches * (count - 1)
        last_tenth = [0]

        def advance(n: int) -> None:
            done = progress.tasks[0].completed + n
            elapsed = progress.tasks[0].elapsed or 0
            progress.update(task, advance=n, rate=f"{done / elapsed:.1f} tok/s" if elapsed else "")
            tenth = 10 * done // total_steps
            if not err.is_terminal and tenth > last_tenth[0]:  # a log file still sees the run move
                last_tenth[0] = tenth
                err.print(f"eval: {done}/{total_steps} steps, {elapsed:.0f} s")

        results = ev.evaluate_rows(loaded.model, stretches, rows, max_rows=max_rows, on_step=advance, speed=speed)
    per_window = [ev.records([r for r in results if r.row.window == window], budgets) for window in range(windows)]
    summary = ev.summarize_windows(per_window)
    records = per_window[0]
    report = {
        "model": loaded.name,
        "text": Path(text).name,
        "tokens": count,
        "budgets": budgets,
        "heavy_ratio": heavy_ratio,
        "sinks": sinks,
        "decay": decay,
        "windows": windows,
        "seed": seed,
        "recall": ev.describe_recalls(recalls),
        "kv_dtypes": kv_dtypes,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "threads": threads.current(),
        "results": records,  # the first window
        "window_results": per_window if windows > 1 else None,
        "summary": summary,
        "speed": {
            "rows": len(rows),
            "batches": batches,
            "forwards": speed.steps,
            "seconds": round(speed.seconds, 2),
            "forwards_per_s": round(speed.steps_per_s, 2),
            "predictions_per_s": round(speed.row_tokens_per_s, 2),
        },
    }
    over = f"{count} tokens of {Path(text).name}" + (f", mean of {windows} windows" if windows > 1 else "")
    plot_failed = None
    if plot is not None:
        from ..measure.plotting import perplexity_plot

        try:
            perplexity_plot(summary, plot, title=f"{loaded.name} on {over}")
        except OSError as exc:  # checked before the model loaded, so rare: the results still print below
            plot_failed = exc
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        out = make_console()
        spread = " (lowest-highest over the windows)" if windows > 1 else ""
        against = "; [ratio to the same policy without recall]" if recalls else ""
        sized = kv_dtypes != ["auto"] or any(ev.budget_bytes(part) for part in budget.split(",") if part.strip())
        out.print(_table(summary, budgets, "perplexity",
                         f"Perplexity over {over} ({loaded.name}); ratio to full{spread}{against}"
                         + ("; device KV bytes of the row" if sized else ""), show_bytes=sized))
        out.print(_table(summary, budgets, "perplexity_after_fill",
                         f"Perplexity of the predictions made after the first eviction; ratio to full over the same "
                         f"ones{spread}"))
        out.print(f"{len(rows)} rows in {batches} batch(es): {speed.steps} forwards in {speed.seconds:.0f} s "
                  f"({speed.steps_per_s:.1f} forwards/s, {speed.row_tokens_per_s:.1f} predictions/s)"
                  + (f"; plot written to {plot}" if plot and not plot_failed else ""))
    if plot_failed is not None:
        raise UserError(f"could not write the plot {plot}: {one_line(plot_failed)} (the results are above)")


def _table(summary: list[dict], budgets: list[int], field: str, title: str, show_bytes: bool = False) -> Table:
    from ..chat.split import format_bytes

    table = Table(title=title, title_justify="left")
    table.add_column("policy")
    for slots in budgets:
        table.add_column(f"{slots} slots", justify="right")
    cells = {(r["policy"], r["budget_slots"]): r for r in summary}
    for policy in dict.fromkeys(r["policy"] for r in summary):
        row = [policy]
        for slots in budgets:
            entry = cells.get((policy, slots))
            if entry is None or entry[field] is None:
                row.append("-")
                continue
            text = f"{entry[field]:.2f}"
            ratio = entry.get(f"{field}_ratio")
            if ratio is not None and policy != "full":
                text += f" ({ratio:.2f}x"
                if entry["windows"] > 1:
                    text += f" {entry[f'{field}_ratio_min']:.2f}-{entry[f'{field}_ratio_max']:.2f}"
                text += ")"
            against = entry.get(f"{field}_vs_policy")
            if against is not None:
                text += f" [{against:.3f}x {entry['without_recall']}]"
            if show_bytes and entry.get("kv_bytes"):
                text += f" {format_bytes(entry['kv_bytes'])}"
            row.append(text)
        table.add_row(*row)
    return table


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
