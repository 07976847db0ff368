"""Comparing two implementations of the decode step without letting a floating-point near-tie decide.

Two implementations that agree up to rounding (eager and compiled, static shapes or not, a batch row
and the same row alone) can still pick different tokens where two candidates nearly tie: the
greedy argmax between two logits, or the eviction's lowest priority between two slots. A test that
compares their tokens one by one then fails on a few seeds in a thousand. So:

- both runs are fed the same tokens (``lockstep``: the first run's greedy choice, fed to both), and
  their logits are compared within a tolerance instead of their argmax;
- their kept tokens are compared after every step; where they differ, the two evicted tokens'
  priorities at the moment of the choice (recorded by ``EvictionRecorder``) must tie within the
  tolerance, and the comparison stops there (from then on the runs attend different tokens).
"""

from __future__ import annotations

import contextlib
import math

import torch

from h2ochat.kv import H2OCache, H2OLayer

# merits this close are a tie: fp32 sums of a few dozen probabilities carry ~1e-6 relative error
TIE_RTOL, TIE_ATOL = 1e-4, 1e-6


class EvictionRecorder:
    """Every steady-state eviction of one (eager) cache's layers: the slots' token indices and the
    priorities the policy gives them at the moment of the choice (this step's attention added).
    It wraps the layers' ``evict_one`` of that cache only: a compiled step never traces it. A policy
    with its own rank (random) is not recorded: asking its priority would draw from its generator
    (and its draws are the same numbers in both runs)."""

    def __init__(self, cache: H2OCache):
        self.cache = cache
        self.snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.near_tie = False  # some choice so far was between candidates whose priorities tie

    @contextlib.contextmanager
    def recording(self):
        if self.cache.fused_eviction_parameters is None:  # a custom rank (random): asking for it would draw
            yield self
            return
        for layer in self.cache.layers:
            layer.evict_one = self._wrap(layer)
        try:
            yield self
        finally:
            for layer in self.cache.layers:
                del layer.evict_one

    def _wrap(self, layer):
        def evict_one(key, value, new_score, token_index, position, value_norm):
            priority = layer.priority(layer.scores, layer.token_index, token_index, layer.value_norm)
            self.snapshots[layer.layer_idx] = (layer.token_index.clone(), priority.clone())
            self.near_tie |= choice_ties(priority)
            return H2OLayer.evict_one(layer, key, value, new_score, token_index, position, value_norm)

        return evict_one


def is_tie(a: float, b: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= TIE_ATOL + TIE_RTOL * max(abs(a), abs(b))


def choice_ties(priority: torch.Tensor) -> bool:
    """Whether the lowest priority of some (sequence, head) [.., S] ties the next lowest (the slot
    to drop could round either way). Empty slots (-inf) are alike, and protected ones (+inf) never go."""
    lowest = priority.topk(2, dim=-1, largest=False).values
    first, second = lowest[..., 0].flatten().tolist(), lowest[..., 1].flatten().tolist()
    return any(is_tie(a, b) for a, b in zip(first, second))


def held(layer, b: int, h: int) -> set[int]:
    tokens = layer.token_index[b, h]
    return set(tokens[tokens >= 0].tolist())


def kept_agree_or_tie(a: H2OCache, b: H2OCache, recorder: EvictionRecorder | None, where: str,
                      rows: list[tuple[int, int]] | None = None) -> bool:
    """True when both caches hold the same tokens in every layer and head of the compared rows
    (``rows``: pairs (row of a, row of b); all rows by default). False when they differ only by an
    eviction whose two candidates tie (priorities ``recorder`` saw in ``a`` within tolerance): the
    runs diverged legitimately. Anything else fails."""
    same = True
    for layer_a, layer_b in zip(a.layers, b.layers):
        if not layer_a.is_initialized:
            continue
        pairs = rows if rows is not None else [(row, row) for row in range(layer_a.token_index.shape[0])]
        for row_a, row_b in pairs:
            for head in range(layer_a.token_index.shape[1]):
                mine, theirs = held(layer_a, row_a, head), held(layer_b, row_b, head)
                if mine == theirs:
                    continue
                here = f"{where} layer {layer_a.layer_idx} row {row_a} head {head}: kept {sorted(mine)} vs {sorted(theirs)}"
                assert recorder is not None and len(mine - theirs) == len(theirs - mine) == 1, here
                tokens, priority = recorder.snapshots[layer_a.layer_idx]
                (only_a,), (only_b,) = mine - theirs, theirs - mine
                slots = tokens[row_a, head].tolist()
                # a kept only_a and dropped only_b, b the other way round: a tie in a's priorities
                p_a, p_b = (float(priority[row_a, head, slots.index(t)]) for t in (only_a, only_b))
                assert is_tie(p_a, p_b), f"{here}: priorities {p_a} vs {p_b}, no tie"  # (inf: protected, never)
                same = False
    return same


def lockstep(first, second, logits, steps: int, *, atol=1e-5, rtol=1e-5, recorder: EvictionRecorder | None = None,
             caches=None, rows=None, pick=None, where="", tolerance=None) -> int:
    """Feed the same tokens to both decode functions (tokens [B] -> logits [B, V]) for ``steps``
    steps: ``pick(step, logits)`` or else the greedy choice of ``first``'s logits, starting from
    ``logits`` ([B, V]). Compares the logits within tolerance (a step's attention comes before its
    eviction, so they are comparable up to the step whose eviction diverged) and, with ``caches``
    (a, b), the kept tokens (``kept_agree_or_tie``). Returns the steps compared before a legitimate
    divergence (``steps`` if none). ``tolerance()``, when given, is asked after each step's two calls for
    that step's (atol, rtol) instead (quantised slots: looser once a key or value took another code)."""
    for step in range(steps):
        token = pick(step, logits) if pick is not None else logits.argmax(-1)
        logits, other = first(token), second(token)
        step_atol, step_rtol = tolerance() if tolerance is not None else (atol, rtol)
        torch.testing.assert_close(other, logits, atol=step_atol, rtol=step_rtol, msg=lambda m: f"{where} step {step}: {m}")
        if caches is not None and not kept_agree_or_tie(*caches, recorder, f"{where} step {step}", rows):
            return step
    return steps


def matches_the_full_reference(model, pieces, full, matching, differing) -> None:
    """Each piece through three masked references (``recall.masked.MaskedRecall``): ``matching`` gives
    ``full``'s logits after every piece, ``differing`` not after some piece (so the check can tell)."""
    differs = False
    for piece in pieces:
        want = full.forward(model, piece)
        torch.testing.assert_close(matching.forward(model, piece), want, atol=1e-4, rtol=1e-4)
        differs |= not torch.allclose(differing.forward(model, piece), want, atol=1e-3, rtol=1e-3)
    assert differs


def prefix_against_masked(model, view: H2OCache, masked: H2OCache, steps: torch.Tensor, **options) -> int:
    """A prefix cache's decode steps (``view``: ``H2OCache.prefix``, the first R rows of a cache) against the
    same steps of a whole cache (``masked``: N rows, the rows after the R left out by ``active``), fed the
    tokens ``steps`` [S, R], in ``lockstep`` (``options``: its tolerances, ``where``): the steps compared."""
    from h2ochat.engine.forward_step import forward

    rows, batch = steps.shape[1], masked.tokens_fed.shape[0]
    active = torch.tensor([True] * rows + [False] * (batch - rows))

    def on_prefix(tokens):  # (the view shares its cache's host counters: nothing is handed over)
        return forward(model, view, tokens.view(-1, 1), logits_to_keep=1)[:, -1]

    def masked_step(tokens):
        everyone = torch.cat([tokens, torch.zeros(batch - rows, dtype=torch.long)])
        return forward(model, masked, everyone.view(-1, 1), logits_to_keep=1, active=active)[:rows, -1]

    recorder = EvictionRecorder(view)
    with recorder.recording():
        return lockstep(on_prefix, masked_step, torch.zeros(rows, 1), steps.shape[0], recorder=recorder,
                        caches=(view, masked), rows=[(row, row) for row in range(rows)],
                        pick=lambda step, _: steps[step], **options)
