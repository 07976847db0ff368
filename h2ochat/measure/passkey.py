"""The pass-key benchmark: can the cache give back a fact it read long ago?

A 5-digit key is planted at a given depth of filler prose ("The pass key is 12345. Remember it."),
then the model is asked "What is the pass key? The pass key is" and continues greedily; the trial
counts as recalled when the digits it writes start with the key. The multi-fact variant plants a
first and a second key (the second at depth 1 - d) and asks for both, in order, the first answer
staying in the conversation. Perplexity hides what this shows:
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

from ..engine.generation import DEFAULT_PREFILL_CHUNK, CacheSettings, forward, prefill
from ..recall.digests import KeyCodes
from ..recall.spec import RecallSpec
from ..recall.tier import RecallTier

KEY_SENTENCE = " The {which}pass key is {key}. Remember it. {key} is the {which}pass key."
QUESTION = "\nWhat is the {which}pass key? The {which}pass key is"
ORDINALS = ("first ", "second ")  # the multi-fact variant: two keys, asked for in this order
ANSWER_TOKENS = 8


@dataclass(frozen=True)
class Trial:
    context: torch.Tensor  # [1, T] filler with the key planted
    question: torch.Tensor  # [1, Q]
    key: str
    depth: float  # where the key sits, as a share of the filler
    length: int  # filler tokens asked for (the context holds a few more: the key sentence)
    window: int  # which stretch of the filler text
    more: tuple = ()  # the multi-fact variant: (key, question [1, Q]) of each later fact, asked in order

    @property
    def keys(self) -> list[str]:
        return [self.key] + [key for key, _ in self.more]


def filler_stretch(ids: Sequence[int], length: int, window: int, windows: int) -> list[int]:
    """The ``window``-th of ``windows`` stretches of ``length`` tokens spread evenly over ``ids``."""
    if len(ids) < length:
        raise ValueError(f"the filler text has {len(ids)} tokens, fewer than the {length} asked for")
    step = (len(ids) - length) // max(windows - 1, 1)
    return list(ids[window * step : window * step + length])


def build_trial(tokenizer, filler_ids: Sequence[int], depth: float, key: str, length: int, window: int = 0,
                second: tuple[str, float] | None = None) -> Trial:
    """Plant ``key`` at ``depth`` (0..1) of the filler, at a token boundary; with ``second`` = (key,
    depth) a second key too, and the two are called the first and second pass key."""
    facts = [(depth, key)] + ([(second[1], second[0])] if second else [])
    names = ORDINALS if second else ("",)
    planted = sorted(zip([d for d, _ in facts], range(len(facts))))
    pieces, start = [], 0
    for fact_depth, which in planted:
        cut = int(round(fact_depth * len(filler_ids)))
        pieces += [tokenizer.decode(list(filler_ids[start:cut])),
                   KEY_SENTENCE.format(key=facts[which][1], which=names[which]) + " "]
        start = cut
    pieces.append(tokenizer.decode(list(filler_ids[start:])))
    context = tokenizer("".join(pieces), add_special_tokens=False, return_tensors="pt")["input_ids"]

    def question(which: str) -> torch.Tensor:
        return tokenizer(QUESTION.format(which=which), add_special_tokens=False, return_tensors="pt")["input_ids"]

    more = ((second[0], question(ORDINALS[1])),) if second else ()
    return Trial(context, question(names[0]), key, depth, length, window, more)


def make_trials(tokenizer, text: str, lengths: Sequence[int], depths: Sequence[float], keys: int,
                seed: int = 0, facts: int = 1) -> list[Trial]:
    """``keys`` trials per (length, depth), each with its own key and its own stretch of the filler.
    ``facts=2``: a second key at depth 1 - depth, asked for after the first."""
    if facts not in (1, 2):
        raise ValueError(f"--facts must be 1 or 2, got {facts}")
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
                second = (f"{rng.randrange(10000, 100000)}", 1.0 - depth) if facts == 2 else None
                trials.append(build_trial(tokenizer, filler_stretch(ids, length, window, keys), depth, key, length,
                                          window, second))
    return trials


def recalled(key: str, answer: str) -> bool:
    """The answer's digits start with the key (spaces and punctuation between digits allowed)."""
    digits = "".join(ch for ch in answer if ch.isdigit())
    return digits.startswith(key)


class Runner(Protocol):
    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed [1, Q] token ids; returns the last token's logits [1, V]."""


class ExactShareTier(RecallTier):
    """A recall tier that keeps the exact selector's digest beside its own selector's and counts, at
    each recall, the share of the exact top pages its selector picked: the figure the masked
    reference's ``OverlapStats`` gives, measured on the real two-tier cache. Recalls where every
    cold page fits in the recall slots are left out (any selector finds them all), and so is a tier
    whose selector turned out exact (``auto`` on a CPU: the tier resolves it when allocated)."""

    def allocate(self, port, batch, heads, head_dim, value_dim, dtype, device) -> None:
        super().allocate(port, batch, heads, head_dim, value_dim, dtype, device)
        self.exact = None if self.selector == "exact" else KeyCodes(
            batch, heads, head_dim, self.cold.page, None, frames=self.cold.frames, device=device, dtype=dtype)
        self.found, self.recalls_counted = 0.0, 0

    def to_cold(self, keys, values, token_index, positions) -> None:
        super().to_cold(keys, values, token_index, positions)
        if self.exact is not None:
            self.exact.append(keys, token_index)

    def recall(self, port, queries: torch.Tensor, rotary, rows: bool | list[bool] = True, rest=None) -> bool:
        count = self.frames.frame_page.shape[-1]
        pages_held = -(-self.cold.held_tokens() // self.cold.page)
        if self.exact is not None and rows is not False and int(pages_held.min()) > count:
            picked = self.digest.top_pages(queries, count)
            exact = self.exact.top_pages(queries, count)
            self.found += float((picked.unsqueeze(-1) == exact.unsqueeze(-2)).any(-1).float().mean())
            self.recalls_counted += 1
        return super().recall(port, queries, rotary, rows, rest)

    def exact_share(self) -> float | None:
        return self.found / self.recalls_counted if self.recalls_counted else None


def exact_share_record(cache) -> dict | None:
    """The share of the exact top pages found, per layer and its mean over layers (None: no recall
    had more cold pages than recall frames); None for a cache whose tiers do not measure it."""
    tiers = [layer.tier for layer in cache.layers
             if isinstance(layer.tier, ExactShareTier) and getattr(layer.tier, "exact", None) is not None]
    if not tiers:
        return None
    per_layer = [tier.exact_share() for tier in tiers]
    known = [x for x in per_layer if x is not None]
    return {"exact_top_pages_found": sum(known) / len(known) if known else None,
            "exact_top_pages_found_per_layer": per_layer}


@dataclass(frozen=True)
class CacheRow:
    """A policy at a budget through the real cache. ``measure``: with recall, also measure the share
    of the exact selector's top pages the row's selector finds (``ExactShareTier``)."""

    label: str
    settings: CacheSettings
    chunk: int = DEFAULT_PREFILL_CHUNK
    question_chunk: int = DEFAULT_PREFILL_CHUNK  # 1: questions token by token (each token recalls for itself)
    measure: bool = False
    # a compiled step's cache (static shapes): by the settings' decode rule "before" (a GPU's), a decode
    # step's pages are chosen before it with the last step's queries; by "in-step", inside it with its own
    static_shapes: bool = False

    @property
    def device_slots(self) -> int | None:
        """Slots the row's cache holds on the device (recall slots among them); None: the full cache."""
        from ..policies import get_policy

        if get_policy(self.settings.policy).grows or not str(self.settings.budget).isdigit():
            return None
        return int(self.settings.budget)

    def instrument(self, cache):
        """A fresh cache of this row's, set to measure its selector where the row asks (the exact
        selector finds its own pages: nothing to measure): its recall tier becomes ``ExactShareTier``."""
        if self.measure and self.settings.recall and self.settings.selector != "exact":
            cache.use_tier(RecallSpec(cache.tier.config, ExactShareTier))
        return cache

    def runner(self, model, trial: Trial) -> Runner:
        initial = trial.context.shape[1] + trial.question.shape[1] + ANSWER_TOKENS
        cache = self.instrument(self.settings.build(model, initial_slots=initial, static_shapes=self.static_shapes))
        row = self

        class _Run:
            fed = 0

            def memory(self) -> dict:
                return cache_memory(cache)

            def feed(self, ids):
                chunk = row.chunk if self.fed == 0 else row.question_chunk
                self.fed += 1
                if ids.shape[1] == 1:
                    return forward(model, cache, ids, logits_to_keep=1)[:, -1]
                return prefill(model, cache, ids, chunk=chunk)
        return _Run()


def cache_memory(cache) -> dict:
    """Device KV bytes and, with recall, the digest's device bytes, the cold store's host bytes, the
    pages copied in and (measured rows) the share of the exact top pages found."""
    figures = {"device_kv_bytes": cache.kv_bytes()}
    tier = cache.tier_record()
    if tier is not None:
        figures.update({name: tier[name] for name in ("digest_device_bytes", "cold_host_bytes", "pages_copied")})
        figures.update(exact_share_record(cache) or {})
    return figures


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
    chunk: int = DEFAULT_PREFILL_CHUNK
    question_chunk: int = DEFAULT_PREFILL_CHUNK  # 1: the question token by token (each token recalls for itself)
    chunk_queries: str = "all"  # which queries of a chunk choose its pages: all, or the last token's
    staged: bool = False  # a decode step's victims wait on a staging page, as the real tier's do
    rest: bool = False  # the unrecalled cold pages still attended, one column each (``MaskedRecall``)
    simulations: list = field(default_factory=list, compare=False, hash=False)  # filled as trials run

    @property
    def device_slots(self) -> int:
        return self.hot_slots + self.recall_slots

    def runner(self, model, trial: Trial) -> Runner:
        from ..recall.masked import MaskedRecall

        MaskedRecall.attach(model)
        sim = MaskedRecall(model.config.num_hidden_layers, self.policy, self.hot_slots, self.recall_slots, self.page,
                           self.selector, grouping=self.grouping, reenter=self.reenter, chunk_queries=self.chunk_queries,
                           staged=self.staged, rest=self.rest)
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


def answer(runner: Runner, trial: Trial, tokenizer, max_new_tokens: int = ANSWER_TOKENS) -> list[str]:
    """Context, then each question in turn, each answered greedily; returns the answers."""
    runner.feed(trial.context)
    answers = []
    for question in [trial.question] + [q for _, q in trial.more]:
        logits = runner.feed(question)
        out = []
        for _ in range(max_new_tokens):
            token = logits.argmax(dim=-1)
            out.append(int(token[0]))
            logits = runner.feed(token.view(1, 1))  # the answer stays in the conversation
        answers.append(tokenizer.decode(out, skip_special_tokens=True))
    return answers


def slots_fields(row, context_tokens: int) -> dict:
    """The row's device slots and the context's length as a multiple of them (None: the full cache)."""
    slots = getattr(row, "device_slots", None)
    return {"device_slots": slots, "slots_ratio": round(context_tokens / slots, 2) if slots else None}


def run(model, tokenizer, trials: Sequence[Trial], rows: Sequence, on_trial: Callable | None = None,
        wanted: Callable | None = None) -> list[dict]:
    """One record per (row, trial), for the pairs ``wanted(row, trial)`` accepts (default: all)."""
    from ..engine.attention import NAME as H2O

    results = []
    for row in rows:
        for trial in trials:
            if wanted is not None and not wanted(row, trial):
                continue
            started = time.perf_counter()
            runner = row.runner(model, trial)
            texts = answer(runner, trial, tokenizer)
            if model.config._attn_implementation != H2O:
                model.set_attn_implementation(H2O)
            each = [recalled(key, text) for key, text in zip(trial.keys, texts)]
            context = int(trial.context.shape[1])
            results.append({"row": row.label, "kv_dtype": getattr(getattr(row, "settings", None), "kv_dtype", "auto"),
                            "length": trial.length, "context_tokens": context,
                            **slots_fields(row, context), "depth": trial.depth, "window": trial.window,
                            "key": trial.key, "answer": texts[0], "recalled": all(each),
                            "seconds": round(time.perf_counter() - started, 2)})
            if trial.more:
                results[-1].update(keys=trial.keys, answers=texts, recalled_each=each)
            if hasattr(runner, "memory"):
                results[-1].update(runner.memory())
            if on_trial is not None:
                on_trial(results[-1])
    return results


def summarize(results: Sequence[dict]) -> list[dict]:
    """Recalled / trials per (row, length, depth), in the order rows first appear; with the facts
    recalled one by one (``recalled_per_fact``) where trials asked for more than one, the context as
    a multiple of the row's device slots, and the mean share of the exact top pages found where the
    row measured it."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["row"], r["length"], r["depth"]), []).append(r)
    out = []
    for (row, length, depth), group in groups.items():
        out.append({"row": row, "length": length, "depth": depth, "recalled": sum(r["recalled"] for r in group),
                    "trials": len(group)})
        if "recalled_each" in group[0]:
            out[-1]["recalled_per_fact"] = [sum(each) for each in zip(*(r["recalled_each"] for r in group))]
        ratios = [r["slots_ratio"] for r in group if r.get("slots_ratio") is not None]
        if ratios:
            out[-1].update(device_slots=group[0]["device_slots"], slots_ratio=round(sum(ratios) / len(ratios), 2))
        shares = [r["exact_top_pages_found"] for r in group if r.get("exact_top_pages_found") is not None]
        if shares:
            out[-1]["exact_top_pages_found"] = sum(shares) / len(shares)
    return out


def wilson_interval(hits: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a hit rate (95% at z = 1.96): unlike hits/trials +- z*sd it stays
    in [0, 1] and is not empty at 0 or all hits, which a pass-key row often scores."""
    if trials <= 0:
        return (0.0, 1.0)
    p = hits / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * ((p * (1 - p) / trials + z * z / (4 * trials * trials)) ** 0.5) / (1 + z * z / trials)
    return (0.0 if hits == 0 else max(0.0, centre - half), 1.0 if hits == trials else min(1.0, centre + half))


def row_totals(results: Sequence[dict]) -> list[dict]:
    """Hits / trials per row over every trial it ran (all texts, lengths and depths), with the 95%
    Wilson interval of its hit rate, in the order rows first appear."""
    groups: dict[str, list[bool]] = {}
    for r in results:
        groups.setdefault(r["row"], []).append(bool(r["recalled"]))
    out = []
    for row, hits in groups.items():
        low, high = wilson_interval(sum(hits), len(hits))
        out.append({"row": row, "recalled": sum(hits), "trials": len(hits), "rate": round(sum(hits) / len(hits), 4),
                    "interval95": [round(low, 4), round(high, 4)]})
    return out
