"""Pass-key trials on real text through the shipped recall tier with a probing subclass of it in its place (what
``recall_query_drift.py`` and ``recall_bound_pruning.py`` share): the arguments, the row, the trials."""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass
from pathlib import Path

from h2ochat import threads
from h2ochat.loading.models import load
from h2ochat.measure import evaluation as ev
from h2ochat.measure import passkey as pk
from h2ochat.measure.passkey_rows import build_rows, parse_numbers
from h2ochat.recall.spec import RecallSpec


@dataclass(frozen=True)
class ProbeRow(pk.CacheRow):
    """A recall row whose cache's tier is ``tier`` (a subclass of ``RecallTier``)."""

    tier: type | None = None

    def instrument(self, cache):
        cache.use_tier(RecallSpec(cache.tier.config, self.tier))
        return cache


def probe_arguments(description: str, *, lengths: str, depths: str, threads_default: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", required=True, help="comma-separated text files")
    parser.add_argument("--lengths", default=lengths)
    parser.add_argument("--depths", default=depths)
    parser.add_argument("--keys", type=int, default=1)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--recall", default="0.5")
    parser.add_argument("--threads", type=int, default=threads_default, help="(0: torch's default)")
    parser.add_argument("--out", required=True)
    return parser


def probe_trials(args, tier: type, page: str, **recall_options) -> dict:
    """Every trial of ``args`` (texts x lengths x depths x keys) through a recall row of ``args.recall`` at
    ``args.budget`` with pages of ``page`` (and ``recall_options``: a selector) whose tier is ``tier``; the
    model fp32 on the CPU. Returns the model's name, the row's label, the texts (with their sha256) and each
    trial's verdict."""
    if args.threads:
        threads.apply(args.threads)
    loaded = load(args.model, "cpu", "float32")
    recalls = ev.recall_settings(args.recall, page, **recall_options)
    base = next(r for r in build_rows(["h2o"], [args.budget], recalls) if r.settings.recall)
    row = ProbeRow(base.label, base.settings, base.chunk, base.question_chunk, tier=tier)
    texts, trials = [], []
    for path in [Path(part) for part in args.text.split(",") if part.strip()]:
        content = path.read_text()
        texts.append({"file": path.name, "sha256": hashlib.sha256(content.encode()).hexdigest()})
        for trial in pk.make_trials(loaded.tokenizer, content, parse_numbers(args.lengths, int, "--lengths"),
                                    parse_numbers(args.depths, float, "--depths"), args.keys):
            answer = pk.answer(row.runner(loaded.model, trial), trial, loaded.tokenizer)[0]
            trials.append({"text": path.name, "depth": trial.depth, "key": trial.key,
                           "recalled": pk.recalled(trial.key, answer)})
    return {"model": loaded.name, "row": row.label, "texts": texts, "trials": trials}
