"""The cache against a slow, obvious re-statement of the H2O rules (DESIGN.md §1).

The reference keeps, per (sequence, KV head), a plain list of (token, key, value, score), computes
attention with explicit loops over query heads and rows, adds each probability to the token's
score, then keeps the R most recent tokens plus the policy's best among the rest. The cache under
test is driven exactly as the attention function drives it, on fresh random inputs each run.
"""

from __future__ import annotations

import math

import pytest
import torch

from h2ochat.kv import H2OCache
from h2ochat.policies import Policy, get_policy

from lockstep import TIE_ATOL, TIE_RTOL


class SlowReference:
    """One layer of an H2O cache for one (sequence, KV head), written for clarity only."""

    def __init__(self, policy: Policy, slots: int):
        budget = policy.split(slots)
        self.policy, self.slots, self.recent, self.sinks = policy, slots, budget.recent, budget.sinks
        self.entries: list[dict] = []  # token, key, value, score
        self.next_token = 0

    def step(self, queries, keys, values, real, scale):
        """queries [G, Q, D]; keys/values [Q, D]; real [Q] bools. Returns outputs [G, Q, D]."""
        group, q_len, _ = queries.shape
        new = []
        for i in range(q_len):
            if real[i]:
                new.append({"token": self.next_token, "key": keys[i], "value": values[i], "score": 0.0, "row": i})
                self.next_token += 1
        outputs = torch.zeros_like(queries)
        for i in range(q_len):
            visible = self.entries + [e for e in new if e["row"] <= i]
            if not visible:
                continue
            if real[i]:  # one real token fed: every score it can see decays once, then gains its attention
                for e in visible:
                    e["score"] *= self.policy.decay
            for g in range(group):
                logits = [float(queries[g, i] @ e["key"]) * scale for e in visible]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                for e, w in zip(visible, weights):
                    outputs[g, i] += (w / total) * e["value"]
                    if real[i]:
                        e["score"] += w / total
        candidates = self.entries + new
        for e in new:
            del e["row"]
        self.entries = self._keep(candidates)
        return outputs

    def _merit(self, e, newest):
        if self.policy.oldest_first:
            return e["token"]
        merit = e["score"]
        if self.policy.by_age:
            merit /= newest - e["token"] + 1
        if self.policy.value_eps is not None:
            merit = (merit + self.policy.value_eps) * float(e["value"].norm())
        return merit

    def _keep(self, candidates):
        if len(candidates) <= self.slots:
            return candidates
        newest = max(e["token"] for e in candidates)
        pinned = [e for e in candidates if e["token"] > newest - self.recent or e["token"] < self.sinks]
        others = [e for e in candidates if e not in pinned]
        room = self.slots - len(pinned)
        best = sorted(others, key=lambda e: self._merit(e, newest), reverse=True)[:room]
        return sorted(best + pinned, key=lambda e: e["token"])




class TieAwareReference(SlowReference):
    """The slow reference, remembering the candidates of its last choice so a tie can be checked
    and the cache's side of it followed."""

    def _keep(self, candidates):
        self.candidates = list(candidates)
        return super()._keep(candidates)

    def follow(self, kept_tokens: list[int], where: str) -> None:
        """The cache kept ``kept_tokens`` where this reference kept others: allowed only between
        unprotected candidates whose merits tie."""
        mine = {e["token"] for e in self.entries}
        theirs = set(kept_tokens)
        by_token = {e["token"]: e for e in self.candidates}
        assert theirs <= set(by_token), f"{where}: the cache holds tokens that were never candidates"
        newest = max(by_token)
        differing = (mine - theirs) | (theirs - mine)
        for token in differing:
            assert not (token > newest - self.recent or token < self.sinks), f"{where}: protected token {token} differs"
        merits = [self._merit(by_token[t], newest) for t in differing]
        assert not self.policy.oldest_first, f"{where}: kept {sorted(theirs)}, reference {sorted(mine)}"
        spread = max(merits) - min(merits)
        assert spread <= TIE_ATOL + TIE_RTOL * max(abs(m) for m in merits), (
            f"{where}: kept {sorted(theirs)}, reference {sorted(mine)}; merits {merits} do not tie")
        self.entries = sorted((by_token[t] for t in theirs), key=lambda e: e["token"])


def _drive(cache: H2OCache, layer_idx: int, query, key, value, new_valid, scale):
    cache.update(key, value, layer_idx)
    return cache.attend(layer_idx, query, key, value, new_valid, scale)


def _kept(layer, b, h):
    tokens = layer.token_index[b, h]
    return sorted(tokens[tokens >= 0].tolist())


def drive_against_reference(cache: H2OCache, make_reference, chunks, group: int, seed, dim: int = 8, tolerance=1e-5,
                            score_rel=1e-5, score_abs=1e-6):
    """Feed ``cache`` (one layer, 2 rows of 2 KV heads, the second row left-padded by 3 tokens) fresh
    random chunks beside one ``make_reference()`` per (row, head), and compare the outputs, kept
    tokens (a tie followed) and scores at every step."""
    batch, kv_heads, scale = 2, 2, dim ** -0.5
    refs = [[make_reference() for _ in range(kv_heads)] for _ in range(batch)]
    pad = 3  # sequence 1 starts with 3 padding tokens
    fed = 0
    for q_len in chunks:
        query = torch.randn(batch, kv_heads * group, q_len, dim)
        key, value = torch.randn(batch, kv_heads, q_len, dim), torch.randn(batch, kv_heads, q_len, dim)
        real = torch.ones(batch, q_len, dtype=torch.bool)
        real[1] = torch.arange(fed, fed + q_len) >= pad
        new_valid = None if bool(real.all()) else real
        out = _drive(cache, 0, query, key, value, new_valid, scale)
        fed += q_len
        layer = cache.layers[0]
        for b in range(batch):
            for h in range(kv_heads):
                ref = refs[b][h]
                expect = ref.step(query[b, h * group:(h + 1) * group], key[b, h], value[b, h], real[b].tolist(), scale)
                rows = real[b]
                torch.testing.assert_close(out[b, h][:, rows], expect[:, rows], rtol=tolerance, atol=tolerance,
                                           msg=lambda m: f"seed={seed}: {m}")
                kept = _kept(layer, b, h)
                if kept != [e["token"] for e in ref.entries]:
                    ref.follow(kept, f"seed={seed} row {b} head {h}")
                held = {int(t): float(s) for t, s in zip(layer.token_index[b, h], layer.scores[b, h]) if t >= 0}
                for e in ref.entries:
                    assert held[e["token"]] == pytest.approx(e["score"], rel=score_rel, abs=score_abs), f"seed={seed}"


@pytest.mark.parametrize("policy,slots,group", [
    ("h2o", 6, 2), ("h2o", 7, 1), ("local", 5, 2), ("sink:sinks=2", 6, 3),
    ("decay:decay=0.5:sinks=1", 7, 2), ("mean:sinks=1", 7, 2), ("tova:sinks=1", 6, 1),
    ("h2o:value_eps=0.05", 6, 2), ("decay:sinks=1:value_eps=0", 7, 3),
])
@pytest.mark.parametrize("chunks", [[1] * 14, [4, 1, 1, 3, 1, 5, 1, 1]], ids=["decode", "chunked"])
def test_cache_matches_slow_reference(policy, slots, group, chunks, seed):
    """Outputs, kept tokens and scores equal the reference at every step, with left padding (a
    choice between candidates whose merits tie within float rounding may go either way: the
    reference checks the tie and follows the cache)."""
    pol = get_policy(policy)
    drive_against_reference(H2OCache(1, pol, slots, max_positions=10_000), lambda: TieAwareReference(pol, slots),
                            chunks, group, seed)


@pytest.mark.parametrize("policy", ["h2o", "local", "sink:sinks=2", "random", "decay", "mean", "tova"])
def test_invariants_while_decoding(policy):
    """Length = min(seen, C); the last R tokens are present; evictions per step = max(0, k - C)."""
    batch, kv_heads, group, dim, slots = 2, 3, 2, 8, 9
    pol = get_policy(policy)
    budget = pol.split(slots)
    cache = H2OCache(2, pol, slots, max_positions=10_000, seed=torch.seed() % 2**31)
    for step in range(30):
        for layer_idx in range(2):
            layer = cache.layers[layer_idx]
            before = int(layer.evicted.sum()) if layer.is_initialized else 0
            _drive(cache, layer_idx, torch.randn(batch, kv_heads * group, 1, dim),
                   torch.randn(batch, kv_heads, 1, dim), torch.randn(batch, kv_heads, 1, dim), None, 0.3)
            seen = step + 1
            assert int(layer.evicted.sum()) - before == batch * kv_heads * max(0, min(1, seen - slots))
            assert layer.keys.shape[2] == slots  # never grows
            for b in range(batch):
                for h in range(kv_heads):
                    kept = _kept(layer, b, h)
                    assert len(kept) == min(seen, slots)
                    last = list(range(max(0, seen - budget.recent), seen))
                    assert set(last) <= set(kept)
                    assert set(range(min(seen, budget.sinks))) <= set(kept)
                    if policy == "local":
                        assert kept == list(range(max(0, seen - slots), seen))
                    if policy.startswith("sink") and seen > slots:
                        assert kept == [0, 1] + list(range(seen - budget.recent, seen))


def test_heavy_ratio_zero_is_a_sliding_window():
    pol = get_policy("h2o:heavy_ratio=0")
    budget = pol.split(6)
    assert (budget.heavy, budget.recent) == (0, 6)
    cache = H2OCache(1, pol, 6, max_positions=10_000)
    for step in range(20):
        _drive(cache, 0, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), None, 0.3)
        for h in range(2):
            assert _kept(cache.layers[0], 0, h) == list(range(max(0, step + 1 - 6), step + 1))


def test_full_policy_grows_and_never_evicts():
    pol = get_policy("full")
    cache = H2OCache(1, pol, 4, max_positions=10_000)
    for _ in range(3):
        _drive(cache, 0, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), None, 0.3)
    assert cache.evicted_tokens() == 0
    assert _kept(cache.layers[0], 0, 0) == list(range(15))


@pytest.mark.parametrize("policy", ["h2o:layer_shape=-0.6", "mean:sinks=1:layer_shape=0.5", "h2o"])
def test_one_position_per_token_in_every_layer_and_head_across_renumberings(policy, seed):
    """Layers of different budgets (and heads holding different tokens) past the position limit: every
    re-numbering gives a token one new position everywhere it is held, in token order, and every
    new token's position id (one for all layers) comes after every held key's, in every layer."""
    pol = get_policy(policy)
    batch, kv_heads, group, dim, slots, layers = 2, 2, 2, 8, 6, 3
    largest = max(pol.layer_slots(slots, layers))
    cache = H2OCache(layers, pol, slots, max_positions=largest + 5)
    for step in range(40):
        position_ids = cache.position_ids(batch, 1)
        for layer_idx in range(layers):
            layer = cache.layers[layer_idx]
            for b in range(batch if layer.is_initialized else 0):
                held = layer.token_index[b] >= 0
                assert bool((layer.positions[b][held] < position_ids[b, 0]).all()), f"step {step} layer {layer_idx}"
            _drive(cache, layer_idx, torch.randn(batch, kv_heads * group, 1, dim) * 3,
                   torch.randn(batch, kv_heads, 1, dim), torch.randn(batch, kv_heads, 1, dim), None, dim ** -0.5)
        for b in range(batch):
            position_of: dict[int, set[int]] = {}
            for layer in cache.layers:
                for t, p in zip(layer.token_index[b].flatten().tolist(), layer.positions[b].flatten().tolist()):
                    if t >= 0:
                        position_of.setdefault(t, set()).add(p)
            assert all(len(p) == 1 for p in position_of.values()), f"step {step} row {b}: {position_of}"
            in_order = [next(iter(position_of[t])) for t in sorted(position_of)]
            assert in_order == sorted(in_order), f"step {step} row {b}: positions out of token order"
            assert position_of[step] == {int(position_ids[b, 0])}  # the new token: the position handed out
    assert cache.compactions >= 3
