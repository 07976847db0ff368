"""Perplexity of a text continued token by token through each policy's cache, at several budgets.

Every (policy, budget) pair is one row of a single batch over the same tokens: one model forward
per token serves all of them, which on a CPU costs little more than one row (the weights are read
once per step whatever the batch). ``kv.make_mixed_cache`` makes that possible: each row follows its
own policy and slot budget and evicts exactly as a cache of its own size would (same slots, same
order, same random draws: tests compare the two).

The first tokens, up to the smallest budget, go in as one chunk: nothing is evicted before a cache
is full, and a chunk's scores equal token-by-token feeding (the decay included), so chunked and
token-by-token feeding are the same computation.

A recall row (``--recall``: the two-tier cache, ``h2ochat.recall``) is a policy whose budget keeps R
of its device slots for tokens recalled from the cold tier. The two-tier cache serves one policy for
all its rows, so each recall row runs as a batch of its own, over the same tokens.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..budget import budget_bytes, parse_budget  # (budget_bytes: eval's table asks it too)
from ..kv import H2OCache, RowSpec
from ..cache_factory import make_cache, make_mixed_cache, policy_slots
from ..kv.slot_format import check_kv_dtype
from ..engine.forward_step import forward
from ..engine.generation import CacheSettings, max_positions
from ..policies import Policy, get_policy
from ..recall.tiered import RecallConfig
from ..rotary import find_rotary

DEFAULT_POLICIES = ("full", "h2o", "local", "sink", "random")
DEFAULT_BUDGETS = "128,256,512"
MAX_ROWS = 16  # rows per batch; more run as further batches


@dataclass(frozen=True)
class Row:
    """One evaluated configuration: a policy at a number of slots."""

    policy: Policy
    slots: int  # the budget asked for (for ``full``: the budget its after-fill numbers compare to)
    seed: int | None = None
    window: int = 0  # which of the evaluated stretches of text this row reads
    recall: RecallConfig | None = None  # the two-tier cache: R of the ``slots`` hold recalled tokens
    recall_spec: str = ""  # --recall as typed (64, or 0.5 of the budget): names the row across budgets
    kv_dtype: str = "auto"  # how its slots hold keys and values (--kv-dtype; kv.slot_format)

    @property
    def hot_slots(self) -> int:
        """The policy's slots: the budget less the recall slots."""
        return policy_slots(self.slots, self.recall)

    @property
    def budget(self):
        return self.policy.split(self.hot_slots)

    @property
    def policy_label(self) -> str:
        """The policy, and the slots' dtype when it is not the model's (``h2o [int8]``)."""
        return self.policy.label + ("" if self.kv_dtype == "auto" else f" [{self.kv_dtype}]")

    @property
    def label(self) -> str:
        if self.recall is None:
            return self.policy_label
        return (f"{self.policy_label} + recall {self.recall_spec} ({self.recall.selector}, pages of {self.recall.page}"
                f"{self.recall.rest_label})")

    def spec(self) -> RowSpec:
        return RowSpec(self.policy, self.slots, self.seed)


# -- evaluation ----------------------------------------------------------------------------------

@dataclass
class RowResult:
    row: Row
    nll: torch.Tensor  # [T - 1] float64: -log p(token j | tokens < j) for j = 1..T-1
    memory: dict = field(default_factory=dict)  # device KV bytes of the row (with recall: digest and cold bytes)


@dataclass
class Speed:
    steps: int = 0  # model forwards (one per token after the opening chunk)
    row_tokens: int = 0  # predictions made, summed over rows
    seconds: float = 0.0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    @property
    def row_tokens_per_s(self) -> float:
        return self.row_tokens / self.seconds if self.seconds else 0.0


def build_rows(policies: Sequence[str | Policy], budgets: Sequence[int], tokens: int, *, seed: int | None = 0,
               window: int = 0, recalls: Sequence[CacheSettings] = (), kv_dtype: str = "auto", full: bool = True,
               **knobs) -> list[Row]:
    """One row per (evicting policy, budget), plus one ``full`` row (its numbers do not depend on
    the budget) when ``full`` is asked for (and ``full``: a table of several --kv-dtype has one full
    row, at the first). ``knobs`` (heavy_ratio=, sinks=, ...; None = the policy's own) apply to
    every policy. ``recalls``: the recall settings (``CacheSettings`` with recall, page, selector,
    ... set), each adding a recall row beside every (evicting policy, budget)."""
    rows = []
    for spec in dict.fromkeys(policies):
        policy = get_policy(spec).with_knobs(**knobs)
        if policy.grows:
            if full:
                rows.append(Row(policy, slots=tokens, window=window, kv_dtype=kv_dtype))
            continue
        for slots in budgets:
            policy.split(slots)  # a knob that does not fit the budget fails before the model runs
            rows.append(Row(policy, slots=slots, seed=seed, window=window, kv_dtype=kv_dtype))
            for settings in recalls:
                row = Row(policy, slots, seed, window, settings.recall_config(slots), str(settings.recall), kv_dtype)
                row.budget  # the hot slots left must hold the policy's sinks and windows
                rows.append(row)
    return rows


def recall_settings(recalls: str, pages: str, **options) -> list[CacheSettings]:
    """--recall (comma-separated: slot counts or shares of each budget) times --page (comma-separated
    page sizes) times --selector (comma-separated), with the other recall options (cold_dtype,
    cold_limit, recall_every)."""
    from .passkey_rows import parse_numbers

    from ..recall.default import AUTO, is_off

    # (0 or off: no recall row; auto, the chat's default, is no one recall setting to put in a table)
    specs = [part.strip() for part in str(recalls).split(",") if part.strip() and not is_off(part)]
    if any(spec.lower() == AUTO for spec in specs):
        raise ValueError("eval's --recall takes slot counts (64) or shares of each budget (0.5), not auto")
    if not specs:
        return []
    selector = options.pop("selector", CacheSettings.selector)
    selectors = dict.fromkeys(part.strip() for part in str(selector).split(",") if part.strip())
    return [CacheSettings(recall=spec, page=page, selector=name, **options)
            for spec in specs for page in dict.fromkeys(parse_numbers(pages, int, "--page")) for name in selectors]


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position: logits [B, Q, V], targets [B, Q] -> [B, Q] float64."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()


def evaluate_rows(model, token_ids: torch.Tensor | Sequence[torch.Tensor], rows: Sequence[Row], *, max_rows: int = MAX_ROWS,
                  on_step: Callable[[int], None] | None = None, speed: Speed | None = None) -> list[RowResult]:
    """Per-token NLL of ``token_ids`` [T] (or of ``token_ids[row.window]``, windows of equal length)
    for every row, running up to ``max_rows`` rows per batch."""
    windows = [token_ids] if isinstance(token_ids, torch.Tensor) else list(token_ids)
    results: dict[int, RowResult] = {}
    for group in batches(rows, max_rows):
        for row, nll, memory in zip(group, *_evaluate_batch(model, windows, group, on_step, speed)):
            results[id(row)] = RowResult(row, nll, memory)
    return [results[id(row)] for row in rows]


def batches(rows: Sequence[Row], max_rows: int = MAX_ROWS) -> list[list[Row]]:
    """Rows without recall share batches of up to ``max_rows`` (similar budgets together); each
    recall row is a batch of its own (the two-tier cache serves one policy)."""
    groups = []
    for kv_dtype in dict.fromkeys(row.kv_dtype for row in rows):  # one cache holds one slot format
        ordered = sorted((row for row in rows if row.recall is None and row.kv_dtype == kv_dtype),
                         key=lambda row: row.slots)
        groups += [ordered[start : start + max_rows] for start in range(0, len(ordered), max_rows)]
    return groups + [[row] for row in rows if row.recall is not None]


def _cache_for(model, rows: Sequence[Row]) -> H2OCache:
    config = model.config
    common = dict(max_positions=max_positions(config), positions="absolute", rotary=find_rotary(model),
                  kv_dtype=rows[0].kv_dtype)
    if rows[0].recall is not None:
        [row] = rows
        return make_cache(config.num_hidden_layers, row.policy, row.slots, recall=row.recall, seed=row.seed, **common)
    return make_mixed_cache(config.num_hidden_layers, [row.spec() for row in rows], **common)


def row_memory(cache: H2OCache, rows: Sequence[Row]) -> list[dict]:
    """Per row: the device KV bytes a cache of that row alone allocates (a mixed batch allocates its
    widest row's slots for every row, so its rows are counted by their own slots per layer), and
    for a recall row what its cold tier holds (``H2OCache.tier_record``)."""
    tier = cache.tier_record()
    if tier is not None:
        return [{"device_kv_bytes": cache.kv_bytes(), **tier}]
    out = []
    for index, _ in enumerate(rows):
        total = 0
        for layer in cache.layers:
            if layer.is_initialized:
                total += layer.budgets[index].slots * layer.slot_bytes()
        out.append({"device_kv_bytes": total})
    return out


def _evaluate_batch(model, windows, rows, on_step, speed):
    config = model.config
    total = windows[0].shape[0]
    cache = _cache_for(model, rows)
    ids = torch.stack([windows[row.window] for row in rows]).to(model.device)
    nll = torch.empty(len(rows), total - 1, dtype=torch.float64)
    started = time.perf_counter()
    # a recall row's policy evicts once its hot slots are full: the opening chunk must not pass them
    smallest = min(min(row.policy.layer_slots(row.hot_slots, config.num_hidden_layers)) for row in rows)
    opening = max(1, min(smallest, total - 1))
    logits = forward(model, cache, ids[:, :opening])
    nll[:, :opening] = token_nll(logits, ids[:, 1 : opening + 1]).cpu()
    if on_step:
        on_step(opening)
    for index in range(opening, total - 1):
        logits = forward(model, cache, ids[:, index : index + 1], logits_to_keep=1)
        nll[:, index] = token_nll(logits, ids[:, index + 1 : index + 2])[:, 0].cpu()
        if on_step:
            on_step(1)
    if speed is not None:
        speed.seconds += time.perf_counter() - started
        speed.steps += 1 + (total - 1 - opening)
        speed.row_tokens += len(rows) * (total - 1)
    return list(nll), row_memory(cache, rows)


def first_evicted_prediction(slots: int) -> int:
    """Index (into the T-1 predictions) of the first one made after a token was evicted.

    Prediction p (of token p+1) is made while feeding token p, attending over the cache plus that
    token. A cache of ``slots`` first evicts after feeding token ``slots``, so the first prediction
    made without some token is the one fed with token ``slots + 1``.
    """
    return slots + 1


def perplexity(nll: torch.Tensor) -> float | None:
    return math.exp(float(nll.mean())) if nll.numel() else None


def records(results: Sequence[RowResult], budgets: Sequence[int]) -> list[dict]:
    """JSON records: one per (policy, budget); ``full`` is reported at every budget, with its
    after-fill perplexity over the same predictions as the evicting policies at that budget. A
    recall row also gives its ratios to the same policy without recall at the same budget
    (``*_vs_policy``), over the same predictions."""
    out = []
    for result in results:
        row = result.row
        tokens = result.nll.numel() + 1
        grows = row.policy.grows
        for slots in (budgets if grows else [row.slots]):
            out.append({
                "policy": row.label,
                "budget_slots": slots,
                "kv_dtype": row.kv_dtype,  # as given to --kv-dtype
                "kv_slots": slots,
                "kv_bytes": None if grows else result.memory.get("device_kv_bytes"),
                "heavy_slots": None if grows else row.budget.heavy,
                "recent_slots": None if grows else row.budget.recent,
                "sink_slots": None if grows else row.budget.sinks,
                "decay": None if grows else row.policy.decay,
                "tokens": tokens,
                "perplexity": perplexity(result.nll),
                "perplexity_after_fill": perplexity(result.nll[first_evicted_prediction(slots):]),
                **({} if grows else result.memory),
            })
            if row.recall is not None:
                out[-1].update(without_recall=row.policy_label, hot_slots=row.hot_slots)
    plain = {(r["policy"], r["budget_slots"]): r for r in out if "without_recall" not in r}
    for record in out:
        base = plain.get((record.get("without_recall"), record["budget_slots"]))
        for field_name in ("perplexity", "perplexity_after_fill") if base else ():
            if record[field_name] is not None and base[field_name]:
                record[f"{field_name}_vs_policy"] = record[field_name] / base[field_name]
    out.sort(key=lambda r: (r["budget_slots"], r["policy"] != "full", r["policy"]))
    return out


def describe_recalls(recalls: Sequence[CacheSettings]) -> list[dict] | None:
    """The recall settings of the rows, for the JSON report."""
    names = ("recall", "page", "selector", "cold_dtype", "cold_limit", "recall_every", "recall_rest")
    return [{name: getattr(r, name) for name in names} for r in recalls] or None


# -- inputs --------------------------------------------------------------------------------------

def parse_budgets(text: str, tokens: int, size_slots: Callable[[str], int] | None = None) -> list[int]:
    """--budget for eval: comma-separated slot counts, fractions of the evaluated tokens, or sizes
    (16MiB: ``size_slots`` turns one into the slots that fit for the model and a --kv-dtype; without
    it, before the model loads, a size is only checked)."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    if not parts:
        raise ValueError("--budget needs at least one value")
    slots = []
    for part in parts:
        if budget_bytes(part) is None:
            slots.append(parse_budget(part, tokens))
        elif size_slots is not None:
            slots.append(size_slots(part))
    return sorted(dict.fromkeys(slots))  # (empty: sizes only, not read yet)


def parse_kv_dtypes(text: str) -> list[str]:
    """--kv-dtype for eval: comma-separated slot dtypes (auto, float32, ..., int8, int4), a row each."""
    parts = [check_kv_dtype(part) for part in str(text).split(",") if part.strip()]
    if not parts:
        raise ValueError("--kv-dtype needs at least one value")
    return list(dict.fromkeys(parts))


def size_slots(model, kv_dtype: str) -> Callable[[str], int]:
    """A --budget size's slots per layer for ``model`` with slots of ``kv_dtype`` (``CacheSettings.slots``)."""
    return lambda size: CacheSettings(budget=size, kv_dtype=kv_dtype).slots(model.config, model)


def parse_policies(text: str | Sequence[str]) -> list[str]:
    """Comma-separated policies, each a name or name:knob=value:... (checked here)."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    specs = [part.strip() for part in parts if part.strip()]
    if not specs:
        raise ValueError("--policies needs at least one policy")
    for spec in specs:
        get_policy(spec)
    return list(dict.fromkeys(specs))


def text_tokens(tokenizer, text: str, tokens: int) -> torch.Tensor:
    """The first ``tokens`` token ids of ``text`` (no BOS or other special tokens), fewer if the
    text is shorter. Only a prefix of a long text is tokenized."""
    if not text.strip():
        raise ValueError("the text is empty")
    chars = max(4096, 8 * tokens)
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) > tokens or chars >= len(text):
            return torch.tensor(ids[:tokens], dtype=torch.long)
        chars *= 2


def text_windows(tokenizer, text: str, tokens: int, windows: int) -> list[torch.Tensor]:
    """``windows`` stretches of ``tokens`` token ids, evenly spread over the text: the first starts
    at its beginning (so one window is exactly ``text_tokens``), the last ends at its end."""
    if windows == 1:
        return [text_tokens(tokenizer, text, tokens)]
    if not text.strip():
        raise ValueError("the text is empty")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < tokens * windows:
        raise ValueError(f"the text has {len(ids)} tokens: too few for {windows} windows of {tokens} "
                         "that do not overlap; use fewer --windows or --tokens")
    step = (len(ids) - tokens) // (windows - 1)
    return [torch.tensor(ids[k * step : k * step + tokens], dtype=torch.long) for k in range(windows)]


def summarize_windows(per_window: Sequence[Sequence[dict]]) -> list[dict]:
    """Per (policy, budget): the mean and spread over windows of the perplexity and of its ratio to
    the full cache's in the same window (the figure that compares policies)."""
    grouped: dict[tuple, list[tuple[dict, dict | None]]] = {}
    for records_of_window in per_window:
        full = {r["budget_slots"]: r for r in records_of_window if r["policy"] == "full"}
        for r in records_of_window:
            grouped.setdefault((r["policy"], r["budget_slots"]), []).append((r, full.get(r["budget_slots"])))
    out = []
    for (policy, slots), pairs in grouped.items():
        entry = {"policy": policy, "budget_slots": slots, "windows": len(pairs),
                 **{name: pairs[0][0].get(name) for name in ("kv_dtype", "kv_bytes")}}
        if "without_recall" in pairs[0][0]:
            entry["without_recall"] = pairs[0][0]["without_recall"]
        for field_name in ("perplexity", "perplexity_after_fill"):
            values = [r[field_name] for r, _ in pairs if r[field_name] is not None]
            ratios = [r[field_name] / f[field_name] for r, f in pairs if f and r[field_name] is not None and f[field_name]]
            entry[field_name] = statistics.fmean(values) if values else None
            if ratios:
                entry[f"{field_name}_ratio"] = statistics.fmean(ratios)
                entry[f"{field_name}_ratio_min"] = min(ratios)
                entry[f"{field_name}_ratio_max"] = max(ratios)
                entry[f"{field_name}_ratio_std"] = statistics.pstdev(ratios)
            against = [r[f"{field_name}_vs_policy"] for r, _ in pairs if f"{field_name}_vs_policy" in r]
            if against:
                entry[f"{field_name}_vs_policy"] = statistics.fmean(against)
                entry[f"{field_name}_vs_policy_max"] = max(against)
        out.append(entry)
    out.sort(key=lambda r: (r["budget_slots"], r["policy"] != "full", r["policy"]))
    return out


def check_inputs(token_count: int, budgets: Sequence[int], position_limit: int) -> None:
    if token_count < 2:
        raise ValueError("the text has fewer than 2 tokens: nothing to predict")
    largest = max(budgets)
    if token_count < largest:
        raise ValueError(f"the text has only {token_count} tokens, fewer than the {largest}-slot budget: "
                         "use a longer text or a smaller --budget")
    if token_count > position_limit:
        raise ValueError(f"{token_count} tokens pass the model's {position_limit}-position limit: "
                         f"use --tokens {position_limit} or fewer")
