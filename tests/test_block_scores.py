"""The vLLM plugin's block score kernel (``h2ochat_kernels.cpu.block_scores_ops``) against the plugin's torch
route (``h2ochat_vllm/scores.py``'s ``decode_block_scores``, the reference; it needs no vLLM), on every variant
this CPU runs (``cpu_routes.block_scores_route``: avx512bf16, avx2, generic), each skipped with its reason where the
CPU or the install lacks it.

Keys are laid out as vLLM's CPU cache holds them: per block and KV head, D channels of ``block_size`` tokens, then
the values. Tolerances: fp32 within 1e-5 relative (atol 1e-6) of the torch route (another order of fp32 sums).
bf16: against the torch route run in fp32 on the same bf16 values within 1e-5 (the kernel's logits are fp32 sums
of exact products); the torch route in bf16 rounds its logits to bf16 first, so against it only within 3e-2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from cpu_routes import block_scores_route, torch_route  # noqa: F401 (fixtures)

from h2ochat_kernels.cpu import block_scores_ops

pytestmark = pytest.mark.usefixtures("block_scores_route")  # every test here on every variant this CPU runs

# the plugin's scores module by its path: the plugin is its own distribution, not installed with h2ochat
_SPEC = importlib.util.spec_from_file_location("h2ochat_vllm_scores",
                                               Path(__file__).parents[1] / "h2ochat_vllm" / "scores.py")
scores = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(scores)


def _cache(num_blocks, kv_heads, block_size, dim, dtype, generator):
    """A layer's cache as vLLM's CPU backend allocates it, [num_blocks, Hkv, block_size, 2 * D], and its keys' view."""
    kv_cache = torch.randn(num_blocks, kv_heads, block_size, 2 * dim, generator=generator).to(dtype)
    return kv_cache, scores.key_view(kv_cache)


def _step(rows, kv_heads, group, dim, block_size, width, dtype, generator, num_blocks=40):
    """R decode rows: queries, the cache's keys, each row's kept blocks (distinct, out of order, the table padded
    past each row's own with other ids) and lengths from 1 token to a full row."""
    _, keys = _cache(num_blocks, kv_heads, block_size, dim, dtype, generator)
    query = torch.randn(rows, kv_heads * group, dim, generator=generator).to(dtype)
    blocks = torch.stack([torch.randperm(num_blocks, generator=generator)[:width] for _ in range(rows)])
    lens = torch.randint(1, width * block_size + 1, (rows,), generator=generator)
    lens[0], lens[-1] = 1, width * block_size
    return query, keys, blocks, lens


def test_the_route_is_the_variant_asked_for(block_scores_route):
    assert block_scores_ops.available(), block_scores_ops.why_not()
    assert block_scores_ops.variant_name() == block_scores_route


def test_the_switch_turns_it_off(torch_route):
    torch_route()
    assert not block_scores_ops.available() and "H2OCHAT_CPU_KERNELS=none" in block_scores_ops.why_not()
    generator = torch.Generator().manual_seed(0)
    assert block_scores_ops.decode_block_scores(*_step(2, 1, 2, 32, 32, 2, torch.float32, generator), 0.2) is None


@pytest.mark.parametrize("rows,kv_heads,group,dim,block_size,width", [
    (8, 3, 3, 64, 32, 5),  # SmolLM2's heads (9 over 3) at vLLM's smallest CPU block
    (3, 2, 4, 32, 128, 3),  # vLLM's default CPU block
    (5, 1, 1, 67, 16, 4),  # a head dim with a tail, one head
    (2, 2, 7, 128, 48, 2),  # more query heads than a tile of four
])
def test_fp32_equals_the_torch_route(rows, kv_heads, group, dim, block_size, width):
    generator = torch.Generator().manual_seed(rows * 100 + dim)
    query, keys, blocks, lens = _step(rows, kv_heads, group, dim, block_size, width, torch.float32, generator)
    got = block_scores_ops.decode_block_scores(query, keys, blocks, lens, dim ** -0.5)
    assert got is not None, block_scores_ops.why_not()
    expected = scores.decode_block_scores(query, keys, blocks, lens, dim ** -0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # each query head's probabilities sum to one; blocks past a row's tokens get nothing
    torch.testing.assert_close(got.sum(dim=1), torch.full((rows,), float(kv_heads * group)), rtol=1e-5, atol=1e-5)
    for row in range(rows):
        assert (got[row, -(-int(lens[row]) // block_size):] == 0).all()


@pytest.mark.parametrize("dim", [64, 67])
def test_bf16_equals_the_torch_route_on_the_same_values(dim):
    generator = torch.Generator().manual_seed(dim)
    query, keys, blocks, lens = _step(6, 3, 3, dim, 32, 4, torch.bfloat16, generator)
    got = block_scores_ops.decode_block_scores(query, keys, blocks, lens, 0.125)
    assert got is not None, block_scores_ops.why_not()
    exact = scores.decode_block_scores(query.float(), keys.float(), blocks, lens, 0.125)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
    rounded = scores.decode_block_scores(query, keys, blocks, lens, 0.125)  # the torch route as it runs in bf16
    torch.testing.assert_close(got, rounded, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count,seq_len", [(5, 70), (32, 96), (32, 32)])
def test_a_chunks_last_queries_equal_the_torch_route(dtype, count, seq_len):
    """A prompt chunk's last ``count`` queries of one request (causal among themselves), as the plugin scores a
    chunk: against ``scores.block_scores`` (in fp32 on the same values for bf16)."""
    generator = torch.Generator().manual_seed(count + seq_len)
    _, keys = _cache(10, 2, 32, 64, dtype, generator)
    query = torch.randn(count, 6, 64, generator=generator).to(dtype)
    blocks = torch.tensor([7, 2, 5])
    got = block_scores_ops.block_scores(query.unsqueeze(0), keys, blocks.view(1, -1), torch.tensor([seq_len]), 0.125)
    assert got is not None, block_scores_ops.why_not()
    expected = scores.block_scores(query.float(), keys.float(), blocks, seq_len, 0.125)
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)


def test_threads_do_not_change_the_result():
    generator = torch.Generator().manual_seed(5)
    query, keys, blocks, lens = _step(7, 3, 3, 64, 32, 6, torch.float32, generator)
    kernel = block_scores_ops._loaded()[0]
    assert kernel is not None, block_scores_ops.why_not()
    one = block_scores_ops._call(kernel, query, keys, blocks, lens, 0.125, 1)
    assert torch.equal(one, block_scores_ops._call(kernel, query, keys, blocks, lens, 0.125, 2))


def test_it_declines_what_it_does_not_take():
    generator = torch.Generator().manual_seed(1)
    query, keys, blocks, lens = _step(2, 1, 2, 32, 32, 2, torch.float32, generator, num_blocks=4)
    assert block_scores_ops.decode_block_scores(query.double(), keys.double(), blocks, lens, 0.2) is None
    assert block_scores_ops.decode_block_scores(query.bfloat16(), keys, blocks, lens, 0.2) is None  # mixed dtypes
    assert block_scores_ops.decode_block_scores(query, keys, blocks.clamp(max=3) + 1, lens, 0.2) is None  # id 4
    assert block_scores_ops.decode_block_scores(query, keys[..., :24], blocks, lens, 0.2) is None  # 24-token blocks
    assert block_scores_ops.decode_block_scores(query, keys, blocks.int(), lens, 0.2) is None
    four = query.unsqueeze(1).expand(2, 4, 2, 32)  # four queries a request, where one holds a single token
    assert block_scores_ops.block_scores(four, keys, blocks, torch.tensor([1, 40]), 0.2) is None
