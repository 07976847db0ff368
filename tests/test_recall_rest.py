"""The masked reference's rest term (``MaskedRecall(rest=True)``): the cold pages it does not recall still
count, one column each, against the full cache and a slow loop."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build_model

from conftest import EXACT, recall_cache
from lockstep import matches_the_full_reference
from h2ochat.engine.attention import use_h2o_attention
from h2ochat.engine.forward_step import forward
from h2ochat.engine.generation import max_positions
from h2ochat.recall.masked import MaskedRecall, _Layer
from h2ochat.config import CacheSettings
from h2ochat.recall.tiered import DEFAULT_REST, RecallConfig
from h2ochat.rotary import find_rotary


@pytest.mark.parametrize("grouping", ["index", "eviction"])
def test_the_rest_with_pages_of_one_token_is_the_full_cache(family, seed, grouping):
    """Every cold token is recalled, staged or a page of its own in the rest, whose mean value is its
    value and whose weight its logit: the attention is the full cache's, with few recall slots."""
    model = build_model(family, seed=seed, max_position_embeddings=256)
    MaskedRecall.attach(model)
    ids = torch.randint(3, VOCAB, (1, 60))
    layers = model.config.num_hidden_layers
    full = MaskedRecall(layers, "full", 10**6, 0, 1)
    rest = MaskedRecall(layers, "h2o", 8, 2, 1, "exact", grouping=grouping, staged=True, rest=True)
    without = MaskedRecall(layers, "h2o", 8, 2, 1, "exact", grouping=grouping, staged=True)
    pieces = [ids[:, :20], ids[:, 20:50], *[ids[:, i : i + 1] for i in range(50, 60)]]
    matches_the_full_reference(model, pieces, full, rest, without)  # (two recall slots alone are not the full cache)
    assert all(int(layer.cold.sum()) > 20 for layer in rest.layers)  # most tokens went cold


def test_the_rest_column_is_each_unrecalled_pages_weight_and_mean_value(seed):
    """``rest_column`` against a loop over heads, query rows and pages (pages by token index)."""
    g = torch.Generator().manual_seed(seed)
    heads, group, q_len, total, page, dim = 2, 3, 2, 23, 4, 5
    cold = torch.rand(heads, total, generator=g) < 0.7
    cold[:, -q_len:] = False  # the step's new tokens
    recalled = cold & (torch.arange(total) // page == 1)  # page 1 of each head is recalled
    state = _Layer(~cold, cold, torch.zeros(heads, total), torch.full((heads, total), -1), torch.zeros(heads, total),
                   cold.sum(1), recalled)
    keys, values = torch.randn(heads, total, dim, generator=g), torch.randn(heads, total, dim, generator=g)
    raw = torch.randn(heads, group, q_len, total, generator=g)
    sim = MaskedRecall(1, "h2o", 4, 8, page, rest=True)
    logit, value = sim.rest_column(state, raw, keys, values, recalled)
    for h in range(heads):
        pages = {}
        for t in range(total):
            if cold[h, t] and not recalled[h, t]:
                pages.setdefault(t // page, []).append(t)
        for gq in range(group):
            for q in range(q_len):
                weights = torch.stack([raw[h, gq, q, members].logsumexp(0) for members in pages.values()])
                means = torch.stack([values[h, members].mean(0) for members in pages.values()])
                share = (weights - weights.logsumexp(0)).exp()
                torch.testing.assert_close(logit[h, gq, q], weights.logsumexp(0))
                torch.testing.assert_close(value[h, gq, q], (share.unsqueeze(-1) * means).sum(0))


def test_no_cold_page_leaves_no_rest(seed):
    heads, total = 2, 6
    none = torch.zeros(heads, total, dtype=torch.bool)
    state = _Layer(~none, none, torch.zeros(heads, total), torch.full((heads, total), -1), torch.zeros(heads, total),
                   torch.zeros(heads, dtype=torch.long), none)
    sim = MaskedRecall(1, "h2o", 4, 8, 2, rest=True)
    logit, value = sim.rest_column(state, torch.randn(heads, 1, 1, total), torch.randn(heads, total, 3),
                                   torch.randn(heads, total, 3), none)
    assert bool((logit == float("-inf")).all()) and bool((value == 0).all())


@pytest.mark.parametrize("kv_dtype,mode", [("auto", "pages"), ("int8", "pages"), ("auto", "prompt")])
def test_the_recall_tiers_rest_is_the_masked_references(family, seed, kv_dtype, mode):
    """``--recall-rest pages`` through the two-tier cache: the same logits at every step (chunks, then
    decode steps past several staging flushes) as the masked reference attending the same rest; and
    different logits from the same cache without it (the rest is attended). ``prompt``: the reference
    attends the rest in the chunks only."""
    model = build_model(family, seed=seed, max_position_embeddings=256)
    layers = model.config.num_hidden_layers

    def real(rest):
        config = RecallConfig(8, 4, "exact", cold_dtype=EXACT, rest=rest)
        return recall_cache(layers, "h2o", 12, recall=config, max_positions=max_positions(model.config),
                            positions="absolute", rotary=find_rotary(model), kv_dtype=kv_dtype)

    with_rest, without = real(mode), real("off")
    masked = MaskedRecall(layers, "h2o", 12, 8, 4, "exact", grouping="eviction", staged=True, rest=True)
    ids = torch.randint(3, VOCAB, (1, 70))
    differs = False
    for piece in [ids[:, :20], ids[:, 20:45], *[ids[:, i : i + 1] for i in range(45, 70)]]:
        MaskedRecall.attach(model)
        masked.rest = mode == "pages" or piece.shape[1] > 1
        want = masked.forward(model, piece)
        use_h2o_attention(model)
        got = forward(model, with_rest, piece, logits_to_keep=1)[:, -1]
        other = forward(model, without, piece, logits_to_keep=1)[:, -1]
        tol = 2e-4 if kv_dtype == "auto" else 5e-2  # (int8 slots: the reference holds the floats)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        differs |= not torch.allclose(other, want, atol=1e-3, rtol=1e-3)
    assert differs
    assert all(int(layer.tier.cold.count.min()) > 8 for layer in with_rest.layers)  # several pages went cold


def test_rest_is_refused_unless_it_is_a_mode():
    with pytest.raises(ValueError, match="--recall-rest must be one of auto, off, pages, prompt"):
        RecallConfig(8, 4, rest="all")


def test_a_cache_with_the_rest_decodes_eagerly(family, seed):
    model = build_model(family, seed=seed, max_position_embeddings=256)

    def cache(rest):
        return recall_cache(model.config.num_hidden_layers, "h2o", 12, recall=RecallConfig(8, 4, rest=rest),
                            max_positions=256)

    assert "--recall-rest pages runs eagerly" in cache("pages").compile_blocker()
    assert cache("off").compile_blocker() is None
    assert cache("auto").compile_blocker() is None  # (auto and prompt: the rest in prompt chunks, which run eagerly)
    assert cache("prompt").compile_blocker() is None


def test_the_products_default_rest_is_the_one_labels_leave_out():
    """``CacheSettings.recall_rest`` (a literal: config imports no torch) is ``DEFAULT_REST``, the mode a row's
    label leaves unnamed; the others are named."""
    assert CacheSettings().recall_rest == DEFAULT_REST == "auto"
    assert RecallConfig(8, 4, rest=DEFAULT_REST).rest_label == ""
    assert RecallConfig(8, 4, rest="off").rest_label == ", the rest left out"
    assert RecallConfig(8, 4, rest="pages").rest_label == ", the rest as pages"
