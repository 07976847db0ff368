"""The packed codes and the page scoring: the torch reference against slow loops, the Triton kernel
against the reference under the interpreter on tiny shapes, and its ``torch.library`` op."""

from __future__ import annotations

import pytest
import torch
from conftest import triton_interpreter_ready

from h2ochat_kernels import recall_reference as ref

needs_interpreter = pytest.mark.skipif(not triton_interpreter_ready(),
                                       reason="needs TRITON_INTERPRET=1 before triton's import")


def _codes(generator, shape, bits):
    return torch.randint(0, 1 << bits, shape, generator=generator).to(torch.uint8)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim", [13, 64])
def test_packed_codes_round_trip_in_the_channel_blocked_layout(seed, bits, dim):
    g = torch.Generator().manual_seed(seed)
    codes = _codes(g, (2, 3, dim), bits)
    packed = ref.pack_codes(codes, bits)
    per_byte = 8 // bits
    width = -(-dim // per_byte)
    assert packed.shape == (2, 3, width) and packed.dtype == torch.uint8
    assert torch.equal(ref.unpack_codes(packed, bits, dim), codes)
    # byte j holds channel j + i * W at bit offset i * bits (padding channels past D are 0)
    for j in range(width):
        for i in range(per_byte):
            channel = j + i * width
            want = codes[..., channel] if channel < dim else torch.zeros_like(codes[..., 0])
            assert torch.equal((packed[..., j] >> (i * bits)) & ((1 << bits) - 1), want)


def _slow_page_scores(q, keys, valid, page):
    """The best q.k of each page over its valid tokens and every query, a loop per page."""
    batch, heads, tokens, _ = keys.shape
    out = torch.full((batch, heads, tokens // page), float("-inf"))
    for b in range(batch):
        for h in range(heads):
            dots = (q[b, h].double() @ keys[b, h].double().T).amax(dim=0)  # [T]
            for n in range(tokens // page):
                members = [float(dots[t]) for t in range(n * page, (n + 1) * page) if valid[b, h, t]]
                if members:
                    out[b, h, n] = max(members)
    return out


# 3 queries score from the codes (a decode step's route), 7 (>= dim / 2) from the keys dequantised once
# (a prompt chunk's): both must be the best q.k of the dequantised keys
@pytest.mark.parametrize("queries", [3, 7], ids=["codes", "dequantised"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_reference_on_packed_codes_scores_the_dequantised_keys(seed, bits, queries):
    g = torch.Generator().manual_seed(seed)
    batch, heads, tokens, dim, page = 2, 2, 12, 13, 4
    q = torch.randn(batch, heads, queries, dim, generator=g)
    codes = _codes(g, (batch, heads, tokens, dim), bits)
    scale = (torch.rand(batch, heads, tokens, generator=g) * 0.3).half()
    offset = torch.randn(batch, heads, tokens, generator=g).half()
    valid = torch.rand(batch, heads, tokens, generator=g) < 0.6
    valid[0, 1, :page] = False  # an empty page
    got = ref.page_scores(q, ref.pack_codes(codes, bits), scale, offset, valid, page, bits)
    keys = codes.float() * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)
    want = _slow_page_scores(q, keys, valid, page)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-4)


def test_reference_is_the_best_dot_product_of_each_page(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 3, 8, generator=g)
    keys = torch.randn(1, 2, 12, 8, generator=g)
    valid = torch.rand(1, 2, 12, generator=g) < 0.7
    got = ref.page_scores(q, keys, None, None, valid, 4)
    torch.testing.assert_close(got, _slow_page_scores(q, keys, valid, 4), atol=1e-5, rtol=1e-5)
    assert torch.equal(got, ref.page_scores(q, keys, torch.ones(1, 2, 12), torch.zeros(1, 2, 12), valid, 4))
    assert ref.top_pages(got, 2).shape == (1, 2, 2)


def _kernel_inputs(seed, kind, tokens, page, dim, queries):
    """Random scoring inputs: codes packed at ``kind`` bits with fp16 scales, or float keys."""
    g = torch.Generator().manual_seed(seed)
    batch, heads = 2, 2
    q = torch.randn(batch, heads, queries, dim, generator=g)
    if isinstance(kind, int):
        codes = ref.pack_codes(_codes(g, (batch, heads, tokens, dim), kind), kind)
        scale = (torch.rand(batch, heads, tokens, generator=g) * 0.2).half()
        offset = torch.randn(batch, heads, tokens, generator=g).half()
        bits = kind
    else:
        codes = torch.randn(batch, heads, tokens, dim, generator=g).to(kind)
        scale = offset = bits = None
    valid = torch.rand(batch, heads, tokens, generator=g) < 0.6
    valid[0, 0, :page] = False  # an empty page scores -inf in both
    return q, codes, scale, offset, valid, page, bits


KINDS = [1, 2, 3, 4, 8, torch.float32, torch.float16]


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("tokens,page,dim,queries", [(32, 4, 12, 3), (24, 4, 16, 1), (48, 16, 64, 2), (32, 4, 12, 8)])
def test_triton_page_scores_match_the_reference(seed, kind, tokens, page, dim, queries):
    from h2ochat_kernels import triton_recall

    args = _kernel_inputs(seed, kind, tokens, page, dim, queries)
    want = ref.page_scores(*args)
    got = triton_recall.page_scores(*args)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("kind", [4, torch.float32], ids=str)
def test_triton_page_scores_read_the_leading_slots_of_a_bigger_store_in_place(seed, kind):
    """A digest scores the first T slots of a store that has more (and a spill slot): a view whose
    slot stride is not T. The kernel reads it through its strides, as the reference reads a copy."""
    from h2ochat_kernels import triton_recall

    q, codes, scale, offset, valid, page, bits = _kernel_inputs(seed, kind, 40, 4, 12, 2)

    def view(t):
        return None if t is None else t[:, :, :32]

    def copy(t):
        return None if t is None else view(t).contiguous()

    assert not view(codes).is_contiguous()
    want = ref.page_scores(q, copy(codes), copy(scale), copy(offset), valid[:, :, :32], page, bits)
    got = triton_recall.page_scores(q, view(codes), view(scale), view(offset), valid[:, :, :32], page, bits)
    finite = ~torch.isinf(want)
    assert torch.equal(finite, ~torch.isinf(got))
    torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-4)


@needs_interpreter
def test_triton_refuses_a_page_size_that_is_not_a_power_of_two():
    from h2ochat_kernels import triton_recall

    with pytest.raises(ValueError, match="power-of-two"):
        triton_recall.page_scores(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 12, 4), None, None,
                                  torch.ones(1, 1, 12, dtype=torch.bool), 6)


@needs_interpreter
@pytest.mark.parametrize("kind", [4, torch.float32], ids=str)
def test_page_scores_op_passes_opcheck_and_compiles_to_one_node(seed, kind):
    """The op's schema, fake implementation and dynamic-shape tracing (opcheck); a fullgraph
    compile of a call holds the op as one node and gives the launcher's result."""
    import torch._dynamo

    from h2ochat_kernels import ops

    args = _kernel_inputs(seed, kind, 32, 4, 12, 3)
    results = torch.library.opcheck(torch.ops.h2ochat.page_scores.default, args)
    assert set(results.values()) == {"SUCCESS"}, results
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        got = torch.compile(ops.page_scores, fullgraph=True, backend=keep)(*args)
    finally:
        torch._dynamo.reset()
    assert "h2ochat.page_scores" in graphs[0].code and "triton" not in graphs[0].code
    torch.testing.assert_close(got, ref.page_scores(*args), atol=1e-4, rtol=1e-4)


@needs_interpreter
def test_selector_scoring_takes_the_triton_launcher_on_the_triton_backend(monkeypatch, seed):
    from h2ochat.recall import selectors as sel
    from h2ochat_kernels import triton_recall

    calls = []
    launcher = triton_recall.page_scores

    def spy(*args):
        calls.append(args[-1])
        return launcher(*args)

    monkeypatch.setattr(triton_recall, "page_scores", spy)
    monkeypatch.setenv("H2OCHAT_KERNELS", "triton")
    keys = torch.randn(2, 3, 4, 12, generator=torch.Generator().manual_seed(seed))
    valid = torch.ones(2, 3, 4, dtype=torch.bool)
    queries = torch.randn(2, 2, 12)
    digest = sel.quant_digest(3)(keys, valid)
    got = sel.quant_score(queries, digest)
    assert calls == [3]
    monkeypatch.setenv("H2OCHAT_KERNELS", "torch")
    torch.testing.assert_close(got, sel.quant_score(queries, digest), atol=1e-4, rtol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("family,policy", [("llama", "sink"), ("neox", "h2o")])
def test_recall_on_triton_is_the_torch_route(monkeypatch, seed, family, policy):
    """A two-tier cache decoding with H2OCHAT_KERNELS=triton (attention and eviction kernels, page
    scores) against the same with torch: close logits at every step, the same tokens hot, recalled
    and cold, and the eviction kernel never empties a recall column. (``sink`` evicts by age: no
    near-tie between scores can split the routes; ``h2o`` over a few steps, where its float sums
    differ in rounding only.)"""
    from conftest import VOCAB, build_model, recall_cache

    from h2ochat.engine.forward_step import forward
    from h2ochat.recall.tiered import RecallConfig
    from h2ochat.rotary import find_rotary
    from test_recall_cache import _assert_each_token_once

    model = build_model(family, seed=seed)
    prompt = torch.randint(3, VOCAB, (2, 20))
    follow = torch.randint(3, VOCAB, (2, 8))
    caches, logits, evictors = [], [], []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("H2OCHAT_KERNELS", backend)
        cache = recall_cache(model.config.num_hidden_layers, policy, 8, recall=RecallConfig(8, 4, "exact"),
                            max_positions=64, rotary=find_rotary(model))
        steps = [forward(model, cache, prompt, logits_to_keep=1)[:, -1]]
        steps += [forward(model, cache, follow[:, i : i + 1], logits_to_keep=1)[:, -1] for i in range(8)]
        caches.append(cache)
        logits.append(torch.stack(steps))
        evictors.append(cache.layers[0].evictor.__name__)
    # the victim is chosen once, in torch, and archived before it is overwritten, on either backend
    assert evictors == ["_evict_to_tier", "_evict_to_tier"]
    assert [cache.layers[0].kernels.name for cache in caches] == ["torch", "triton"]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    for want, got in zip(*(cache.layers for cache in caches)):
        assert torch.equal(got.token_index, want.token_index)  # hot and recalled columns
        assert torch.equal(got.tier.cold.token_index, want.tier.cold.token_index)
        assert torch.equal(got.tier.frames.copied, want.tier.frames.copied) and int(want.tier.frames.copied.sum()) > 0
        for row in range(2):
            _assert_each_token_once(got, row, 28)
