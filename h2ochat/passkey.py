"""The pass-key benchmark: can the cache give back a fact it read long ago?

A 5-digit key is planted at a given depth of filler prose ("The pass key is 12345. Remember it."),
then the model is asked "What is the pass key? The pass key is" and continues greedily; the trial
counts as recalled when the digits it writes start with the key. Perplexity hides what this shows:
a policy that drops the key's tokens can never say it again, however good its perplexity.

The context and the question go in as two prefills (the question is a new turn of a chat, which is
how a user asks for a fact), then the answer is decoded token by token. A row is any way of running
the cache: a policy at a budget through the real ``H2OCache`` (``CacheRow``), or the masked reference
simulation of recall (``MaskedRow``, ``h2ochat.recall.masked``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from .generation import CacheSettings, forward, prefill

KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8


@dataclass(frozen=True)
class Trial:
    context: torch.Tensor  # [1, T] filler with the key planted
    question: torch.Tensor  # [1, Q]
    key: str
    depth: float  # where the key sits, as a share of the filler
    length: int  # filler tokens asked for (the context holds a few more: the key sentence)
    window: int  # which stretch of the filler text


def filler_stretch(ids: Sequence[int], length: int, window: int, windows: int) -> list[int]:
    """The ``window``-th of ``windows`` stretches of ``length`` tokens spread evenly over ``ids``."""
    if len(ids) < length:
        raise ValueError(f"the filler text has {len(ids)} tokens, fewer than the {length} asked for")
    step = (len(ids) - length) // max(windows - 1, 1)
    return list(ids[window * step : window * step + length])


def build_trial(tokenizer, filler_ids: Sequence[int], depth: float, key: str, length: int, window: int = 0) -> Trial:
    """Plant ``key`` at ``depth`` (0..1) of the filler, at a token boundary."""
    cut = int(round(depth * len(filler_ids)))
    text = (tokenizer.decode(list(filler_ids[:cut])) + KEY_SENTENCE.format(key=key) + " "
            + tokenizer.decode(list(filler_ids[cut:])))
    context = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    question = tokenizer(QUESTION, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return Trial(context, question, key, depth, length, window)


def make_trials(tokenizer, text: str, lengths: Sequence[int], depths: Sequence[float], keys: int,
                seed: int = 0) -> list[Trial]:
    """``keys`` trials per (length, depth), each with its own key and its own stretch of the filler."""
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depths are shares of the filler in [0, 1], got {depth}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    trials = []
    for length in lengths:
        for depth in depths:
            for window in range(keys):
                key = f"{rng.randrange(10000, 100000)}"
                trials.append(build_trial(tokenizer, filler_stretch(ids, length, window, keys), depth, key, length, window))
    return trials


def recalled(key: str, answer: str) -> bool:
    """The answer's digits start with the key (spaces and punctuation between digits allowed)."""
    digits = "".join(ch for ch in answer if ch.isdigit())
    return digits.startswith(key)


class Runner(Protocol):
    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed [1, Q] token ids; returns the last token's logits [1, V]."""


@dataclass(frozen=True)
class CacheRow:
    """A policy at a budget through the real cache."""

    label: str
    settings: CacheSettings

    def runner(self, model, trial: Trial) -> Runner:
        cache = self.settings.build(model, initial_slots=trial.context.shape[1] + trial.question.shape[1] + ANSWER_TOKENS)

        class _Run:
            def feed(self, ids):
                if ids.shape[1] == 1:
                    return forward(model, cache, ids, logits_to_keep=1)[:, -1]
                return prefill(model, cache, ids)
        return _Run()


@dataclass(frozen=True)
class MaskedRow:
    """The masked reference simulation of recall (``h2ochat.recall.masked.MaskedRecall``)."""

    label: str
    policy: str
    hot_slots: int
    recall_slots: int
    page: int = 16
    selector: str = "exact"
    grouping: str = "index"
    reenter: bool = False
    chunk: int = 512
    question_chunk: int = 512  # 1: the question token by token (each token recalls for itself)
    simulations: list = field(default_factory=list, compare=False, hash=False)  # filled as trials run

    def runner(self, model, trial: Trial) -> Runner:
        from .recall.masked import MaskedRecall

        MaskedRecall.attach(model)
        sim = MaskedRecall(model.config.num_hidden_layers, self.policy, self.hot_slots, self.recall_slots, self.page,
                           self.selector, grouping=self.grouping, reenter=self.reenter)
        self.simulations.append(sim)
        row = self

        class _Run:
            fed = 0

            def feed(self, ids):
                chunk = row.chunk if self.fed == 0 else row.question_chunk
                self.fed += 1
                logits = None
                for start in range(0, ids.shape[1], chunk):
                    logits = sim.forward(model, ids[:, start : start + chunk])
                return logits
        return _Run()


def answer(runner: Runner, trial: Trial, tokenizer, max_new_tokens: int = ANSWER_TOKENS) -> str:
    """Context, then question, then greedy decoding."""
    runner.feed(trial.context)
    logits = runner.feed(trial.question)
    out = []
    for index in range(max_new_tokens):
        token = logits.argmax(dim=-1)
        out.append(int(token[0]))
        if index + 1 < max_new_tokens:
            logits = runner.feed(token.view(1, 1))
    return tokenizer.decode(out, skip_special_tokens=True)


def run(model, tokenizer, trials: Sequence[Trial], rows: Sequence, on_trial: Callable | None = None) -> list[dict]:
    """One record per (row, trial)."""
    from .attention import NAME as H2O

    results = []
    for row in rows:
        for trial in trials:
            started = time.perf_counter()
            text = answer(row.runner(model, trial), trial, tokenizer)
            if model.config._attn_implementation != H2O:
                model.set_attn_implementation(H2O)
            results.append({"row": row.label, "length": trial.length, "context_tokens": int(trial.context.shape[1]),
                            "depth": trial.depth, "window": trial.window, "key": trial.key, "answer": text,
                            "recalled": recalled(trial.key, text), "seconds": round(time.perf_counter() - started, 2)})
            if on_trial is not None:
                on_trial(results[-1])
    return results


def summarize(results: Sequence[dict]) -> list[dict]:
    """Recalled / trials per (row, length, depth), in the order rows first appear."""
    groups: dict[tuple, list[bool]] = {}
    for r in results:
        groups.setdefault((r["row"], r["length"], r["depth"]), []).append(r["recalled"])
    return [{"row": row, "length": length, "depth": depth, "recalled": sum(hits), "trials": len(hits)}
            for (row, length, depth), hits in groups.items()]
