"""The attention a step's queries give each kept KV block of each request, in one C call a layer
(``csrc/block_scores_*``), read in place from vLLM's CPU key cache: the score pass of the vLLM plugin
(``h2ochat_vllm``), whose torch route gathers every kept block's keys into a copy first.

vLLM's CPU attention (its ``vec`` and ``vec16`` kernels, the ones an x86 CPU without AMX runs) stores a block's keys
for one KV head channel-major: channel d's ``block_size`` tokens side by side. ``decode_block_scores`` takes that
layout as the 4-D view ``keys`` [num_blocks, Hkv, D, block_size] (unit stride along the tokens; the block and head
strides are the cache's, values and all) and computes, per request r and KV head h, the G query heads of h of each
of the request's last Q queries against the tokens of its first ``ceil(seq_lens[r] / block_size)`` blocks (query i
sees the places up to its own, ``seq_lens[r] - Q + i``), a softmax over those tokens per query head, and each
block's share summed over queries, query heads and KV heads: ``[R, K]`` float32, 0 for blocks past the request's
tokens. ``decode_block_scores`` is the decode step's case (Q = 1, every request at once); ``block_scores`` takes a
prompt chunk's last Q queries too. The variant that runs is ``routes.cpu_route("block_scores")``'s: ``avx512bf16``
(bf16 keys dotted by VDPBF16PS), ``avx2`` or ``generic`` (vectors of 8 or 4 floats). Sums are fp32 in every
variant; logits are not rounded to bf16 as torch's bf16 matmul rounds them (tests/test_block_scores.py states the
tolerances). vLLM serves a float32 checkpoint in bf16 on the CPU by default, so its caches are bf16 there.

It returns None for anything it does not take (another dtype or device, a head dim past ``MAX_HEAD_DIM``, a block
size that is not a multiple of 16, a block id outside the cache, a request holding fewer tokens than its queries,
logits past ``MAX_WORKSPACE_FLOATS`` a thread, a compiled graph; no kernel built): the caller
keeps its torch route. Each variant is checked against a plain float64 computation the first time it loads, in
bf16 and fp32; one that disagrees is never used.
"""

from __future__ import annotations

import torch

from . import routes

FLOATS = (torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 512
TOKEN_TILE = 16  # tokens a vector pass takes at once on the widest variant: a block holds whole tiles
MAX_WORKSPACE_FLOATS = 1 << 24  # a thread's logits (Q x G x K x block_size): past 64 MiB, the torch route's chunks
# products (query heads x tokens x channels) a thread takes before a second one joins (~2 ms of work): a parallel
# region ends when its last thread is done, and on cores other processes share that thread may wait a scheduler
# slice to run: a layer's pass for 8 decoding requests took ~0.25 ms on one thread and 20-40 ms on two on this
# machine under load. A layer's pass for a few dozen requests, or a prompt chunk's 32 scoring queries, stays on one.
WORK_PER_THREAD = 1 << 25


def _checked(library):
    # the bare cffi functions: tensors go as addresses (csrc/block_scores_api.h), no per-argument casts
    kernel = (library.h2ochat_block_scores.function, library.h2ochat_block_scores_workspace.function)
    return kernel if all(_agrees_in(kernel, dtype) for dtype in FLOATS) else None


def _loaded() -> tuple[object | None, str]:
    """(the bound kernel of the route that runs here, "") or (None, why none does)."""
    return routes.cpu_checked("block_scores", _checked)


def available() -> bool:
    return _loaded()[0] is not None


def why_not() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    return _loaded()[1]


def variant_name() -> str | None:
    variant, _ = routes.cpu_route("block_scores")
    return None if variant is None or _loaded()[0] is None else variant.name


def _takes(query, keys, blocks, seq_lens) -> bool:
    if torch.compiler.is_compiling() or query.dim() != 4 or keys.dim() != 4 or blocks.dim() != 2:
        return False
    rows, count, heads, dim = query.shape
    num_blocks, kv_heads, key_dim, block_size = keys.shape
    if not (query.dtype == keys.dtype and query.dtype in FLOATS and dim == key_dim and dim <= MAX_HEAD_DIM
            and kv_heads > 0 and heads % kv_heads == 0 and block_size % TOKEN_TILE == 0 and keys.stride(3) == 1
            and count * heads // kv_heads * blocks.shape[1] * block_size <= MAX_WORKSPACE_FLOATS
            and all(t.device.type == "cpu" for t in (query, keys, blocks, seq_lens))
            and blocks.dtype == torch.long and seq_lens.dtype == torch.long and blocks.shape[0] == rows
            and seq_lens.shape == (rows,) and blocks.stride(1) == 1):
        return False
    if rows == 0 or blocks.shape[1] == 0:
        return True
    # (only the blocks that hold a request's tokens are read; every id in the table is a cache block in vLLM)
    return int(blocks.min()) >= 0 and int(blocks.max()) < num_blocks and int(seq_lens.min()) >= count


def block_scores(query: torch.Tensor, keys: torch.Tensor, blocks: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> torch.Tensor | None:
    """query [R, Q, H, D] (each request's last Q queries, rotated; head h * G + g is query head g of KV head h),
    keys [num_blocks, Hkv, D, block_size] (vLLM's CPU key cache, module docstring), blocks [R, K] int64 (each
    request's kept blocks in order, any block id past its own), seq_lens [R] int64 (the tokens those blocks hold,
    the step's own included, last) -> [R, K] float32, the attention each block got, summed over queries and heads;
    None where the kernel does not take these (module docstring)."""
    if not _takes(query, keys, blocks, seq_lens):
        return None
    kernel = _loaded()[0]
    if kernel is None:
        return None
    rows, count, heads, dim = query.shape
    work = rows * count * heads * blocks.shape[1] * keys.shape[3] * dim
    threads = max(1, min(torch.get_num_threads(), work // WORK_PER_THREAD))
    return _call(kernel, query, keys, blocks, seq_lens, scale, threads)


def decode_block_scores(query: torch.Tensor, keys: torch.Tensor, blocks: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float) -> torch.Tensor | None:
    """``block_scores`` for R requests that each decode one token: query [R, H, D]."""
    return block_scores(query.unsqueeze(1), keys, blocks, seq_lens, scale) if query.dim() == 3 else None


def _call(kernel, query, keys, blocks, seq_lens, scale, threads) -> torch.Tensor:
    scores, workspace_floats = kernel
    if query.dim() == 3:
        query = query.unsqueeze(1)
    rows, count, heads, dim = query.shape
    kv_heads, block_size = keys.shape[1], keys.shape[3]
    width = blocks.shape[1]
    query, seq_lens = query.contiguous(), seq_lens.contiguous()
    threads = max(1, min(threads, rows * kv_heads))
    group = heads // kv_heads
    workspace = torch.empty(workspace_floats(rows, count, kv_heads, group, width, block_size, dim, threads),
                            dtype=torch.float32)
    out = torch.empty(rows, width, dtype=torch.float32)
    scores(query.data_ptr(), rows, count, kv_heads, group, dim, keys.data_ptr(), keys.stride(0), keys.stride(1),
           keys.stride(2), block_size, blocks.data_ptr(), blocks.stride(0), width, seq_lens.data_ptr(), float(scale),
           out.data_ptr(), query.element_size(), workspace.data_ptr(), threads)
    return out


def _plain(query, keys, blocks, seq_lens, scale) -> torch.Tensor:
    """The same scores the obvious way, one request at a time in float64: the load-time check's yardstick."""
    rows, count, heads, dim = query.shape
    kv_heads, block_size = keys.shape[1], keys.shape[3]
    out = torch.zeros(rows, blocks.shape[1], dtype=torch.float64)
    for r in range(rows):
        length = int(seq_lens[r])
        used = -(-length // block_size)
        row_keys = keys[blocks[r, :used]].double().permute(1, 0, 3, 2).reshape(kv_heads, -1, dim)[:, :length]
        q = query[r].double().view(count, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [Hkv, Q, G, D]
        logits = torch.einsum("hqgd,hsd->hqgs", q, row_keys) * scale
        later = torch.arange(length).view(1, -1) > torch.arange(length - count, length).view(-1, 1)  # [Q, S]
        logits = logits.masked_fill(later.view(1, count, 1, length), float("-inf"))
        probs = torch.softmax(logits, dim=-1).sum(dim=(0, 1, 2))
        padded = torch.zeros(used * block_size, dtype=torch.float64)
        padded[:length] = probs
        out[r, :used] = padded.view(used, block_size).sum(dim=1)
    return out.float()


def _agrees_in(kernel, dtype: torch.dtype) -> bool:
    """Odd sizes (a head dim with a tail, 3 query heads a KV head), rows of 1, 17 and a full table's tokens, blocks
    out of order, a cache whose keys share a block with its values (vLLM's), two threads, one query a request and
    five (causal among themselves): against ``_plain``."""
    generator = torch.Generator().manual_seed(0)
    num_blocks, kv_heads, group, dim, block_size = 9, 2, 3, 67, 32
    cache = torch.randn(num_blocks, kv_heads, 2, dim, block_size, generator=generator).to(dtype)
    keys = cache[:, :, 0]
    blocks = torch.tensor([[4, 0, 7], [8, 2, 2], [1, 3, 6]])
    seq_lens = torch.tensor([1, 17, 96])
    agree = True
    for count in (1, 5):
        query = torch.randn(3, count, kv_heads * group, dim, generator=generator).to(dtype)
        lens = seq_lens.clamp(min=count)
        got = _call(kernel, query, keys, blocks, lens, 0.3, 2)
        agree = agree and bool(torch.allclose(got, _plain(query, keys, blocks, lens, 0.3), rtol=1e-4, atol=1e-5))
    return agree
