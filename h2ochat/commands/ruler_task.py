"""`h2ochat eval --task ruler` and `--task chat-memory`: scored samples per cache row, logged as
they finish (``--output``, resumable), summed up per row, task and length with binomial intervals."""

from __future__ import annotations

import json
from pathlib import Path


from ..measure import evaluation as ev
from ..measure import passkey_rows as pk
from ..measure import score_table
from ..console import make_console, print_table
from ..errors import UserError, one_line, user_input
from ..measure.eval_log import EvalLog, Eta, fingerprint
from .common import loading


def cache_name(row, budget: str) -> str:
    """The row's name independent of the length: its policy, recall, slot format and budget as typed."""
    from ..policies import get_policy

    policy = get_policy(row.settings.policy)
    if policy.grows:
        return "full"
    name = policy.label + (" + recall" if row.settings.recall else "")
    if row.settings.kv_dtype != "auto":
        name += f" [{row.settings.kv_dtype}]"
    return f"{name} @ {budget}"


def rows_for(names, budget: str, tokens: int, recalls, kv_dtypes) -> list[tuple[str, object, int]]:
    """(cache name, ``passkey.CacheRow``, slots) for each policy at each budget of ``tokens`` (shares
    are of it), recall rows beside each evicting one, each --kv-dtype; the full cache once."""
    out, seen = [], set()
    for part in [p.strip() for p in budget.split(",") if p.strip()]:
        slots = ev.parse_budgets(part, tokens)[0]
        for row in pk.build_rows(names, [slots], recalls, kv_dtypes=kv_dtypes):
            name = cache_name(row, part)
            if name not in seen:
                seen.add(name)
                out.append((name, row, slots))
    return out


def sample_task(*, task: str, model: str, device: str, dtype: str, budget: str, policies: str, lengths: str,
                ruler_tasks: str, turns: str, samples: int, recalls: list, kv_dtypes: tuple, output: Path | None,
                seed: int, as_json: bool, plot: Path | None) -> None:
    from ..measure import chat_memory as cm
    from ..measure import ruler
    from ..engine.generation import max_positions
    from ..loading.models import load

    with user_input():  # the options as typed, before the model loads
        if samples < 1:
            raise ValueError(f"--samples must be at least 1, got {samples}")
        names = ev.parse_policies(policies)
        if task == "ruler":
            task_names = ruler.parse_tasks(ruler_tasks)
            length_list = pk.parse_numbers(lengths, int, "--lengths")
            if min(length_list) < 64:
                raise ValueError(f"--lengths are prompt tokens of at least 64, got {min(length_list)}")
            ruler.check_lm_eval()
        else:
            length_list = cm.parse_depths(turns)
        for length in length_list:
            rows_for(names, budget, max(length, 64), recalls, kv_dtypes)  # bad budgets fail here
        log = EvalLog(output)
    err = make_console(stderr=True)  # reads no markup: a row such as h2o [int8] prints as it is
    with loading(err, model):
        loaded = load(model, device, dtype)
    limit = max_positions(loaded.model.config)
    work = []  # (cache name, row, slots, sample, run)
    with user_input():
        for length in length_list:
            if task == "ruler":
                if length + 128 > limit:
                    raise ValueError(f"--lengths {length} and its answer pass the model's {limit}-position window")
                batch = [s for name in task_names for s in ruler.build_samples(loaded.tokenizer, name, length, samples, seed)]
                tokens, run = length, ruler.run_sample
            else:
                batch = cm.make_samples([length], samples, seed=seed)
                tokens, run = _conversation_tokens(loaded.tokenizer, batch[0]), cm.run_sample
                if tokens > limit:
                    raise ValueError(f"--turns {length}: ~{tokens} tokens pass the model's {limit}-position window")
            rows = rows_for(names, budget, tokens, recalls, kv_dtypes)
            # sample by sample, every row on each: a run cut short has compared the rows on the same samples
            work += [(name, row, slots, sample, run) for sample in sorted(batch, key=lambda s: s.index)
                     for name, row, slots in rows]

    # the log's key of each: (row, task, length, sample id, digest); a chat-memory sample's length is its depth
    # the digest covers the model and its dtype too: a log grown by another model's run starts over
    digests = {id(sample): fingerprint((sample, loaded.name, str(next(loaded.model.parameters()).dtype)))
               for _, _, _, sample, _ in work}
    keys = [(row.label, sample.task, sample.length, sample.index, digests[id(sample)]) for _, row, _, sample, _ in work]
    eta = Eta(len(work), sum(log.done(k) for k in keys))
    if eta.done:
        err.print(f"{task}: {eta.done} of {len(work)} samples already in {output}, resuming")
    for (name, row, slots, sample, run), k in zip(work, keys):
        if log.done(k):
            continue
        record = run(loaded.model, loaded.tokenizer, row, sample)
        record.update(digest=k[-1], cache=name, budget_slots=None if name == "full" else slots,
                      kv_dtype=row.settings.kv_dtype)
        log.add(record)
        err.print(f"{task} {eta.step()}: {name}, {record['task']} {record['length']}, sample {record['sample']}: "
                  f"score {record['score']:.2f} ({record['seconds']:.1f} s)")
    results = log.matching(keys)
    summary = score_table.summarize(results)
    report = {"task": task, "model": loaded.name, "lengths": length_list, "samples": samples, "seed": seed,
              "budget": budget, "policies": names, "recall": ev.describe_recalls(recalls) if recalls else None,
              "kv_dtypes": list(kv_dtypes), "output": str(output) if output else None, "summary": summary}
    if task == "ruler":
        report["ruler_tasks"] = task_names
    plot_failed = None
    if plot is not None:
        try:
            score_table.score_plot(summary, plot, title=f"{task}, {loaded.name}")
        except OSError as exc:
            plot_failed = exc
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        titles, cells = score_table.table_cells(summary)
        print_table(f"{task} score % [95% interval] n=samples ({loaded.name}; columns: task and "
                    f"{'prompt tokens' if task == 'ruler' else 'filler turns'})", titles, cells)
    if plot_failed is not None:
        raise UserError(f"could not write the plot {plot}: {one_line(plot_failed)} (the results are above)")


def _conversation_tokens(tokenizer, sample) -> int:
    """Tokens a chat-memory conversation reaches, about (its messages, replies and template marks):
    what budget shares are of."""
    from ..measure import chat_memory as cm

    messages = [f.message for f in sample.facts] + list(sample.fillers) + [f.question for f in sample.facts]
    text = len(tokenizer(" ".join(messages), add_special_tokens=False)["input_ids"])
    return text + len(messages) * (cm.REPLY_TOKENS + 16)
