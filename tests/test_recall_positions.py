"""Recall past the model's position limit (compact positions): the two-tier cache re-numbers its hot
slots, recall slots and cold stores with one function, against the masked reference doing the same
re-numbering the slow way."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build_model

from h2ochat.engine.attention import use_h2o_attention
from h2ochat.engine.forward_step import forward
from h2ochat.recall.masked import MaskedRecall
from conftest import EXACT, recall_cache
from h2ochat.recall.tiered import RecallConfig
from h2ochat.rotary import find_rotary

HOT, RECALL, PAGE, LIMIT = 12, 8, 4, 40


def _positions_everywhere(cache) -> dict[int, set[int]]:
    """token -> every position it has in any layer's hot or recall slots or cold store (row 0)."""
    found: dict[int, set[int]] = {}
    for layer in cache.layers:
        first, end = layer.tier.cold.held()
        pages = torch.arange(int(end.max())).expand(1, layer.keys.shape[1], -1)
        pages = pages.masked_fill(pages < first.unsqueeze(-1), -1)
        _, _, cold_index, cold_positions = layer.tier.cold.pages(pages)
        for index, positions in ((layer.token_index, layer.positions), (cold_index, cold_positions)):
            for t, p in zip(index[0].flatten().tolist(), positions[0].flatten().tolist()):
                if t >= 0:
                    found.setdefault(t, set()).add(p)
    return found


@pytest.mark.parametrize("selector", ["exact", "int4"])
def test_recall_past_the_position_limit_is_the_masked_reference(family, seed, selector):
    """Chunks then decode steps well past the limit: the same logits at every step as the masked
    reference (whose keys are re-rotated at each re-numbering); after each step every token has one
    position everywhere (hot, recall and cold, every layer and head), below the limit and in token
    order, and each recalled key is the reference's key of that token at its current position."""
    model = build_model(family, seed=seed, max_position_embeddings=LIMIT)
    layers, rotary = model.config.num_hidden_layers, find_rotary(model)
    real = recall_cache(layers, "h2o", HOT, recall=RecallConfig(RECALL, PAGE, selector, candidates=64, cold_dtype=EXACT), max_positions=LIMIT,
                       positions="compact", rotary=rotary)
    masked = MaskedRecall(layers, "h2o", HOT, RECALL, PAGE, selector, grouping="eviction", measure=False, staged=True,
                          max_positions=LIMIT, rotary=rotary)
    # every token id once: after a re-numbering many tokens share a position, and two equal ids at one
    # position would have equal keys (exact ties between pages)
    ids = (torch.randperm(VOCAB - 3)[:90] + 3).view(1, -1)
    pieces = [ids[:, :20], ids[:, 20:36], *[ids[:, i : i + 1] for i in range(36, 90)]]
    for step, piece in enumerate(pieces):
        MaskedRecall.attach(model)
        want = masked.forward(model, piece)
        use_h2o_attention(model)
        got = forward(model, real, piece, logits_to_keep=1)[:, -1]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4, msg=lambda m: f"step {step}: {m}")
        assert real.compactions == masked.compactions
        found = _positions_everywhere(real)
        assert all(len(p) == 1 for p in found.values()), f"step {step}: a token with two positions"
        in_order = [next(iter(found[t])) for t in sorted(found)]
        assert in_order == sorted(in_order) and 0 <= in_order[0] and in_order[-1] < LIMIT, f"step {step}"
        assert sorted(found) == list(range(masked.seen))  # nothing lost
        assert [found[t] for t in sorted(found)] == [{p} for p in masked.position]
        for layer, reference in zip(real.layers, masked.cache.layers):
            recalled = layer.tier.recalled_token_index()[0]  # [H, R]
            for head in range(recalled.shape[0]):
                tokens = recalled[head]
                held = tokens >= 0
                torch.testing.assert_close(layer.keys[0, head, HOT:][held], reference.keys[0, head, tokens[held]],
                                           atol=1e-5, rtol=1e-5)
    assert real.compactions >= 3
    assert all(int(layer.tier.frames.copied.sum()) > 0 for layer in real.layers)
