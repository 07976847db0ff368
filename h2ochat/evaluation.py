"""Perplexity of a text continued token by token through each policy's cache, at several budgets.

Every (policy, budget) pair is one row of a single batch over the same tokens: one model forward
per token serves all of them, which on a CPU costs little more than one row (the weights are read
once per step whatever the batch). ``RowPolicyCache`` makes that possible: it is an ``H2OCache``
whose rows each follow their own policy and slot budget. Every row gets the largest budget's
slots; a row with a smaller budget fills its first slots in order, and once it holds its own
number of tokens its spare slots are marked unusable, so from then on it evicts exactly as a
cache of its own size would (same slots, same order, same random draws: tests compare the two).

The first tokens, up to the smallest budget, go in as one chunk: nothing is evicted before a cache
is full, so chunked and token-by-token feeding are the same computation.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .budget import parse_budget
from .cache import H2OCache, H2OLayer
from .generation import forward, max_positions
from .policies import Policy, SlotBudget, get_policy
from .rotary import find_rotary

DEFAULT_POLICIES = ("full", "h2o", "local", "sink", "random")
DEFAULT_BUDGETS = "128,256,512"
MAX_ROWS = 16  # rows per batch; more run as further batches


@dataclass(frozen=True)
class Row:
    """One evaluated configuration: a policy with its share-out of a number of slots."""

    policy: Policy
    budget: SlotBudget
    slots: int  # the budget asked for (for ``full``: the budget its after-fill numbers compare to)
    seed: int | None = None


class RowPolicyLayer(H2OLayer):
    """An ``H2OLayer`` whose decode step evicts per row, by the row's own policy and budget."""

    def _place(self, key, value, new_scores, new_valid, token_index, positions) -> None:
        q_len = key.shape[2]
        if q_len > 1 or new_valid is not None:
            if new_valid is not None or self.used + q_len > self.owner.smallest_slots:
                raise ValueError("a multi-token step must fit every row's budget (the opening chunk only)")
            return super()._place(key, value, new_scores, new_valid, token_index, positions)
        # rows fill their slots from the left, so the occupied slots of every row lie in [:used];
        # a free slot ranks -inf, so a row below its own budget takes one instead of evicting
        self.used = min(self.used + 1, self.capacity)
        self._evict_one(key, value, new_scores, token_index[:, 0], positions[:, 0])

    def _priority(self, scores, token_index, newest):
        return self.owner.row_priority(scores, token_index, newest)


class RowPolicyCache(H2OCache):
    """Rows of one batch, each with its own policy and budget (see the module notes)."""

    def __init__(self, rows: Sequence[Row], num_layers: int, *, max_positions: int, rotary=None):
        capacity = max(row.budget.slots for row in rows)
        shared = SlotBudget(capacity, heavy=0, recent=capacity)
        super().__init__(num_layers, get_policy("local"), shared, max_positions=max_positions,
                         positions="absolute", rotary=rotary)
        self.layers = [RowPolicyLayer(self) for _ in range(num_layers)]
        self.rows = list(rows)
        self.smallest_slots = min(row.budget.slots for row in rows)
        self._slots = torch.tensor([row.budget.slots for row in rows])
        self._recent = torch.tensor([row.budget.recent for row in rows])
        self._generators = [
            torch.Generator().manual_seed(row.seed) if row.seed is not None else None for row in rows
        ]
        by_policy: dict[str, list[int]] = {}
        for index, row in enumerate(rows):
            by_policy.setdefault(row.policy.name, []).append(index)
        self._groups = [(rows[indices[0]], torch.tensor(indices)) for indices in by_policy.values()]

    def row_priority(self, scores: torch.Tensor, token_index: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        """Keep priority [B, Hkv, C] of every slot, each row by its own policy (lowest goes).

        Same rules as ``policies.keep_priority`` per row, plus: while a row holds fewer tokens than
        its budget its empty slots rank lowest (the new token fills one); once it holds its budget
        they rank highest (never used), so the row evicts among its own tokens.
        """
        device = scores.device
        held = (token_index >= 0).sum(dim=-1, keepdim=True)
        full = held >= self._slots.to(device).view(-1, 1, 1)
        rank = torch.zeros_like(scores)
        for first, indices in self._groups:
            if first.policy.name == "random":
                continue
            indices = indices.to(device)
            rank[indices] = first.policy.rank(scores[indices], token_index[indices], first.budget, None)
        for index, row in enumerate(self.rows):
            # random draws happen only when the row evicts, with the shape its own cache would
            # draw, so the sequence of draws matches a cache of that size seeded alike
            if row.policy.name == "random" and bool(full[index].all()):
                slots = row.budget.slots
                part = (slice(index, index + 1), slice(None), slice(0, slots))
                # drawn on the CPU, where the generator lives, as a cache of its own would on a CPU
                drawn = row.policy.rank(scores[part].cpu(), token_index[part].cpu(), row.budget,
                                        self._generators[index])
                rank[part] = drawn.to(device)
        recent = token_index > (newest - self._recent.to(device)).view(-1, 1, 1)
        rank = rank.masked_fill(recent, float("inf"))
        empty_rank = torch.where(full, float("inf"), float("-inf")).to(rank.dtype)
        return torch.where(token_index < 0, empty_rank, rank)


# -- evaluation ----------------------------------------------------------------------------------

@dataclass
class RowResult:
    row: Row
    nll: torch.Tensor  # [T - 1] float64: -log p(token j | tokens < j) for j = 1..T-1


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


def build_rows(policies: Sequence[str], budgets: Sequence[int], tokens: int, *, heavy_ratio: float = 0.5,
               sinks: int = 4, seed: int | None = 0) -> list[Row]:
    """One row per (evicting policy, budget), plus one ``full`` row (its numbers do not depend on
    the budget) when ``full`` is asked for."""
    rows = []
    for name in dict.fromkeys(policies):
        policy = get_policy(name)
        if policy.name == "full":
            rows.append(Row(policy, policy.split(tokens), slots=tokens))
            continue
        for slots in budgets:
            rows.append(Row(policy, policy.split(slots, heavy_ratio, sinks), slots=slots, seed=seed))
    return rows


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position: logits [B, Q, V], targets [B, Q] -> [B, Q] float64."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()


def evaluate_rows(model, token_ids: torch.Tensor, rows: Sequence[Row], *, max_rows: int = MAX_ROWS,
                  on_step: Callable[[int], None] | None = None, speed: Speed | None = None) -> list[RowResult]:
    """Per-token NLL of ``token_ids`` [T] for every row, running up to ``max_rows`` rows per batch."""
    ordered = sorted(rows, key=lambda row: row.budget.slots)  # similar budgets share a batch
    results: dict[int, RowResult] = {}
    for start in range(0, len(ordered), max_rows):
        group = ordered[start : start + max_rows]
        for row, nll in zip(group, _evaluate_batch(model, token_ids, group, on_step, speed)):
            results[id(row)] = RowResult(row, nll)
    return [results[id(row)] for row in rows]


def _evaluate_batch(model, token_ids, rows, on_step, speed):
    config = model.config
    total = token_ids.shape[0]
    cache = RowPolicyCache(rows, config.num_hidden_layers, max_positions=max_positions(config),
                           rotary=find_rotary(model))
    ids = token_ids.to(model.device).unsqueeze(0).expand(len(rows), total)
    nll = torch.empty(len(rows), total - 1, dtype=torch.float64)
    started = time.perf_counter()
    opening = max(1, min(cache.smallest_slots, total - 1))
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
    return list(nll)


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
    after-fill perplexity over the same predictions as the evicting policies at that budget."""
    out = []
    for result in results:
        row = result.row
        tokens = result.nll.numel() + 1
        slot_list = budgets if row.policy.name == "full" else [row.slots]
        for slots in slot_list:
            out.append({
                "policy": row.policy.name,
                "budget_slots": slots,
                "heavy_slots": row.budget.heavy if row.policy.name != "full" else None,
                "recent_slots": row.budget.recent if row.policy.name != "full" else None,
                "sink_slots": row.budget.sinks if row.policy.name != "full" else None,
                "tokens": tokens,
                "perplexity": perplexity(result.nll),
                "perplexity_after_fill": perplexity(result.nll[first_evicted_prediction(slots):]),
            })
    out.sort(key=lambda r: (r["budget_slots"], r["policy"] != "full", r["policy"]))
    return out


# -- inputs --------------------------------------------------------------------------------------

def parse_budgets(text: str, tokens: int) -> list[int]:
    """--budget for eval: comma-separated slot counts, or fractions of the evaluated tokens."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    if not parts:
        raise ValueError("--budget needs at least one value")
    return sorted(dict.fromkeys(parse_budget(part, tokens) for part in parts))


def parse_policies(text: str | Sequence[str]) -> list[str]:
    parts = text.split(",") if isinstance(text, str) else list(text)
    names = [part.strip().lower() for part in parts if part.strip()]
    if not names:
        raise ValueError("--policies needs at least one policy")
    for name in names:
        get_policy(name)
    return list(dict.fromkeys(names))


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
