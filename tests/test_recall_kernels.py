"""The Triton page scoring against its torch reference, under the interpreter on tiny shapes."""

from __future__ import annotations

import pytest
import torch
from conftest import triton_interpreter_ready

from h2ochat_kernels import recall_reference as ref

pytestmark = pytest.mark.skipif(not triton_interpreter_ready(), reason="needs TRITON_INTERPRET=1 before triton's import")


@pytest.mark.parametrize("codes_dtype", [torch.uint8, torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,page,dim,queries", [(32, 4, 12, 3), (24, 4, 16, 1), (48, 16, 64, 2)])
def test_triton_page_scores_match_the_reference(seed, codes_dtype, tokens, page, dim, queries):
    from h2ochat_kernels import triton_recall

    g = torch.Generator().manual_seed(seed)
    batch, heads = 2, 2
    q = torch.randn(batch, heads, queries, dim, generator=g)
    if codes_dtype == torch.uint8:
        codes = torch.randint(0, 16, (batch, heads, tokens, dim), generator=g).to(torch.uint8)
        scale = torch.rand(batch, heads, tokens, generator=g) * 0.2
        offset = torch.randn(batch, heads, tokens, generator=g)
    else:
        codes = torch.randn(batch, heads, tokens, dim, generator=g).to(codes_dtype)
        scale, offset = torch.ones(batch, heads, tokens), torch.zeros(batch, heads, tokens)
    valid = torch.rand(batch, heads, tokens, generator=g) < 0.6
    valid[0, 0, :page] = False  # an empty page scores -inf in both
    want = ref.page_scores(q, codes, scale, offset, valid, page)
    got = triton_recall.page_scores(q, codes, scale, offset, valid, page)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-4)


def test_reference_is_the_best_dot_product_of_each_page(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 3, 8, generator=g)
    keys = torch.randn(1, 2, 12, 8, generator=g)
    valid = torch.rand(1, 2, 12, generator=g) < 0.7
    got = ref.page_scores(q, keys, torch.ones(1, 2, 12), torch.zeros(1, 2, 12), valid, 4)
    for h in range(2):
        for n in range(3):
            dots = [float(q[0, h, m] @ keys[0, h, t]) for m in range(3) for t in range(4 * n, 4 * n + 4) if valid[0, h, t]]
            assert got[0, h, n] == float("-inf") if not dots else abs(float(got[0, h, n]) - max(dots)) < 1e-5
    assert ref.top_pages(got, 2).shape == (1, 2, 2)


def test_triton_refuses_a_page_size_that_is_not_a_power_of_two():
    from h2ochat_kernels import triton_recall

    with pytest.raises(ValueError, match="power-of-two"):
        triton_recall.page_scores(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 12, 4), torch.ones(1, 1, 12),
                                  torch.zeros(1, 1, 12), torch.ones(1, 1, 12, dtype=torch.bool), 6)


@pytest.mark.parametrize("family,policy", [("llama", "sink"), ("neox", "h2o")])
def test_recall_on_triton_is_the_torch_route(monkeypatch, seed, family, policy):
    """A RecallCache decoding with H2OCHAT_KERNELS=triton (attention and eviction kernels, page
    scores) against the same with torch: close logits at every step, the same tokens hot, recalled
    and cold, and the eviction kernel never empties a recall column. (``sink`` evicts by age: no
    near-tie between scores can split the routes; ``h2o`` over a few steps, where its float sums
    differ in rounding only.)"""
    from conftest import VOCAB, build_model

    from h2ochat.forward_step import forward
    from h2ochat.recall.tiered import RecallCache, RecallConfig
    from h2ochat.rotary import find_rotary
    from test_recall_cache import _assert_each_token_once

    model = build_model(family, seed=seed)
    prompt = torch.randint(3, VOCAB, (2, 20))
    follow = torch.randint(3, VOCAB, (2, 8))
    caches, logits, evictors = [], [], []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("H2OCHAT_KERNELS", backend)
        cache = RecallCache(model.config.num_hidden_layers, policy, 8, recall=RecallConfig(8, 4, "exact"),
                            max_positions=64, rotary=find_rotary(model))
        steps = [forward(model, cache, prompt, logits_to_keep=1)[:, -1]]
        steps += [forward(model, cache, follow[:, i : i + 1], logits_to_keep=1)[:, -1] for i in range(8)]
        caches.append(cache)
        logits.append(torch.stack(steps))
        evictors.append(cache.layers[0].evictor.__name__)
    assert evictors == ["_evict_by_torch_priority", "_evict_by_kernel_priority"]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    for want, got in zip(*(cache.layers for cache in caches)):
        assert torch.equal(got.token_index, want.token_index)  # hot and recall columns
        assert torch.equal(got.cold.token_index, want.cold.token_index)
        assert torch.equal(got.frames.copied, want.frames.copied) and int(want.frames.copied.sum()) > 0
        for row in range(2):
            _assert_each_token_once(got, row, 28)
