"""Page selectors against slow loops, and the masked reference's recall path against the full cache."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import VOCAB, build_model
from lockstep import matches_the_full_reference

import h2ochat_kernels as kernels
from h2ochat.recall import selectors as sel
from h2ochat.recall.masked import MaskedRecall

H, M, N, P, D = 2, 3, 5, 4, 8


def _pages(generator):
    keys = torch.randn(H, N, P, D, generator=generator)
    valid = torch.rand(H, N, P, generator=generator) < 0.7
    valid[:, 0] = False  # an empty page
    valid[:, 1, 0] = True  # pages with at least one valid slot
    return keys, valid


def test_exact_score_is_the_best_dot_product_of_each_page(seed):
    g = torch.Generator().manual_seed(seed)
    keys, valid = _pages(g)
    queries = torch.randn(H, M, D, generator=g)
    got = sel.exact_score(queries, sel.exact_digest(keys, valid))
    for h, n in itertools.product(range(H), range(N)):
        dots = [float(queries[h, m] @ keys[h, n, p]) for m in range(M) for p in range(P) if valid[h, n, p]]
        assert (got[h, n] == float("-inf")) if not dots else abs(float(got[h, n]) - max(dots)) < 1e-5


@pytest.mark.parametrize("name", ["quest", "quest2"])
def test_quest_bound_is_the_slow_formula_and_bounds_every_key(seed, name):
    g = torch.Generator().manual_seed(seed)
    keys, valid = _pages(g)
    queries = torch.randn(H, M, D, generator=g)
    selector = sel.get_selector(name)
    got = selector.score(queries, selector.digest(keys, valid))
    exact = sel.exact_score(queries, (keys, valid))
    sub = 2 if name == "quest2" else P
    for h, n in itertools.product(range(H), range(N)):
        best = float("-inf")
        for m, start in itertools.product(range(M), range(0, P, sub)):
            members = [keys[h, n, p] for p in range(start, start + sub) if valid[h, n, p]]
            if members:
                stack = torch.stack(members)
                low, high = stack.min(0).values, stack.max(0).values
                best = max(best, float(torch.maximum(queries[h, m] * low, queries[h, m] * high).sum()))
        assert got[h, n] == best if best == float("-inf") else abs(float(got[h, n]) - best) < 1e-4
        assert float(got[h, n]) >= float(exact[h, n]) - 1e-4  # an upper bound of every key's q.k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [2, 4])
def test_low_bit_keys_round_to_the_nearest_level(seed, bits, dtype):
    """Within half a step of the stored scale (codes rounded against the fp16 scale and offset as
    stored; the offset's own rounding is all a 16-bit one adds)."""
    keys = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(seed))
    codes, scale, offset = sel.quantize(keys, bits, dtype)
    assert int(codes.max()) <= (1 << bits) - 1 and scale.dtype == offset.dtype == dtype
    error = (sel.dequantize(codes, scale, offset) - keys).abs()
    slack = 1e-6 if dtype == torch.float32 else offset.float().abs() * 2.0**-11 + 1e-6
    assert bool((error <= scale.float() / 2 + slack).all())


@pytest.mark.parametrize("name", ["int3", "int4", "rot2", "rot4"])
def test_low_bit_selectors_score_their_dequantised_keys_exactly(seed, name):
    """intN / rotN digests hold packed codes; their scores are the exact scores of the keys they
    dequantise to (rotN: rotated keys against rotated queries)."""
    g = torch.Generator().manual_seed(seed)
    keys, valid = _pages(g)
    queries = torch.randn(H, M, D, generator=g)
    bits, rotate = int(name[3:]), name.startswith("rot")
    selector = sel.get_selector(name)
    (packed, scale, offset), _, _ = digest = selector.digest(keys, valid)
    assert packed.shape == (H, N, P, -(-D // (8 // bits))) and scale.dtype == torch.float16
    turned = sel.rotated(keys) if rotate else keys
    codes, want_scale, want_offset = sel.quantize(turned, bits, torch.float16)
    assert torch.equal(packed, kernels.pack_codes(codes, bits))
    approx = sel.dequantize(codes, want_scale, want_offset)
    want = sel.exact_score(sel.rotated(queries) if rotate else queries, (approx, valid))
    torch.testing.assert_close(selector.score(queries, digest), want, atol=1e-4, rtol=1e-4)


def test_bytes_ratios_are_the_packed_layout():
    """Device bytes of a token's digest against its 16-bit key (D = 64): int3 packs 2 to a byte."""
    ratio = {name: sel.get_selector(name).bytes_ratio(16, 64) for name in ("int1", "int2", "int3", "int4", "int8",
                                                                           "rot3")}
    assert ratio == {"int1": 12 / 128, "int2": 20 / 128, "int3": 36 / 128, "int4": 36 / 128, "int8": 68 / 128,
                     "rot3": 36 / 128}


def test_representative_keys_are_the_most_important_valid_ones(seed):
    g = torch.Generator().manual_seed(seed)
    keys, valid = _pages(g)
    importance = torch.rand(H, N, P, generator=g)
    chosen, chosen_valid = sel.reps_digest(2)(keys, valid, importance)
    for h, n in itertools.product(range(H), range(N)):
        order = sorted((p for p in range(P) if valid[h, n, p]), key=lambda p: -float(importance[h, n, p]))[:2]
        got = [chosen[h, n, i] for i in range(2) if chosen_valid[h, n, i]]
        assert len(got) == len(order) and all(torch.equal(a, keys[h, n, p]) for a, p in zip(got, order))


def test_top_pages_leave_out_empty_pages():
    scores = torch.tensor([[3.0, float("-inf"), 1.0, 2.0], [float("-inf")] * 4])
    assert sel.top_pages(scores, 3).tolist() == [[0, 3, 2], [-1, -1, -1]]


@pytest.mark.parametrize("grouping", ["index", "eviction"])
def test_recalling_every_cold_page_is_the_full_cache(family, seed, grouping):
    """With recall slots for every page, every evicted token is recalled: the logits are the full
    cache's, whatever the selector's order (chunked prefill, then decode)."""
    model = build_model(family, seed=seed, max_position_embeddings=256)
    MaskedRecall.attach(model)
    ids = torch.randint(3, VOCAB, (1, 60))
    layers = model.config.num_hidden_layers
    full = MaskedRecall(layers, "full", 10**6, 0, 4)
    recall = MaskedRecall(layers, "h2o", 8, 64, 4, "quest", grouping=grouping)
    small = MaskedRecall(layers, "h2o", 8, 4, 4, "quest", grouping=grouping)
    pieces = [ids[:, :20], ids[:, 20:50], *[ids[:, i : i + 1] for i in range(50, 60)]]
    matches_the_full_reference(model, pieces, full, recall, small)  # (a single recall page is not the full cache)
    assert all(bool(layer.cold.any()) for layer in recall.layers)  # tokens were evicted and recalled


@pytest.mark.parametrize("grouping", ["index", "eviction"])
def test_pages_hold_the_cold_tokens_by_index_or_by_eviction_order(seed, grouping):
    from h2ochat.recall.masked import _Layer

    g = torch.Generator().manual_seed(seed)
    heads, total, page = 2, 23, 4
    cold = torch.rand(heads, total, generator=g) < 0.5
    cold[:, 0] = True
    evicted_at = torch.full((heads, total), -1, dtype=torch.long)
    for h in range(heads):  # a random eviction order of the cold tokens
        members = cold[h].nonzero().flatten()
        evicted_at[h, members[torch.randperm(len(members), generator=g)]] = torch.arange(len(members))
    state = _Layer(~cold, cold, torch.zeros(heads, total), evicted_at, torch.rand(heads, total, generator=g),
                   cold.sum(1), torch.zeros_like(cold))
    keys = torch.randn(heads, total, D, generator=g)
    sim = MaskedRecall(1, "h2o", 4, 8, page, grouping=grouping)
    paged_keys, valid, importance, token = sim.paged(state, keys)
    for h in range(heads):
        slots = {}
        for t in range(total):
            if cold[h, t]:
                number = t if grouping == "index" else int(evicted_at[h, t])
                slots[(number // page, number % page)] = t
        for n, p in itertools.product(range(valid.shape[1]), range(page)):
            t = slots.get((n, p))
            assert bool(valid[h, n, p]) == (t is not None)
            if t is not None:
                assert int(token[h, n, p]) == t and torch.equal(paged_keys[h, n, p], keys[h, t])
                assert importance[h, n, p] == state.importance[h, t]


@pytest.mark.parametrize("bits", [1, 2])
def test_box_codes_stay_inside_the_page_box_within_half_a_step(seed, bits):
    g = torch.Generator().manual_seed(seed)
    keys, valid = _pages(g)
    codes, step, low, _ = sel.box_digest(bits)(keys, valid)
    approx = codes.float() * step + low
    error = (approx - keys).abs().masked_fill(~valid.unsqueeze(-1), 0)
    assert bool((error <= step / 2 + 1e-5).all())
    assert int(codes.max()) <= (1 << bits) - 1
