"""Attention with its H2O scores in one C call (``csrc/attention_*``), for a decode step's new token or a prompt
chunk's: each (sequence, KV head) row's keys read once, then its values once, where the torch route takes separate
passes for the slot logits, the slot outputs and the scores (47% of a served step in the server's profile, the
prompt chunks' attention another 31% of the server's time, benchmarks/results_peers_idle.json). Timings:
benchmarks/cpu_attention.py (one call: results_cpu_attention.json for decode steps,
results_cpu_attention_chunks.json for prompt chunks; whole steps: results_cpu_attention_routed.json).

``attend_with_scores`` is ``reference.attend_with_scores`` for what the kernel takes (``takes``): up to 512 new
tokens (Q = 1 a decode step; Q > 1 a chunk, causal among its tokens, each query row's probabilities weighed in the
scores by the decay as the reference weighs them; a chunk's tokens go 64 at a time, each (sequence, KV head, block)
a unit of work for the threads), float slots of the query's dtype (bf16 or fp32) with unit stride along D (any view
of a larger slot buffer), D <= 256, any group G, a padding mask, a float decay or one per sequence, and in an eager
step a recall tier's rest column. Everything ``takes`` reads is a shape, a dtype, a stride or a device, never a
value, so a ``torch.compile`` trace decides as an eager call does. Quantized slots, a longer chunk, another dtype or
device stay on the caller's torch route.

Routed by default: the torch backend (``dispatch.Backend``) sends a CPU step here when the kernel loads on this
machine, ``H2OCHAT_CPU_ATTENTION=0`` or ``H2OCHAT_CPU_KERNELS=none`` turns it off (read when a cache layer
chooses its backend). An eager step calls the kernel directly; a compiled step calls it as the custom op
``torch.ops.h2ochat.cpu_attend_with_scores`` (one opaque node in the graph, ``scores`` declared written in place,
a fake implementation giving the output shapes), so the eager and the compiled step take the same route and run the
same kernel on the same inputs.

The variant that runs is ``routes.cpu_route("attention")``'s: ``avx512bf16`` (bf16 keys dotted by VDPBF16PS) or
``avx2`` (vectors of 8 floats); ``auto`` never takes ``generic`` (no faster than torch), which runs only when named.
Sums are fp32 in every variant, in another order than torch's: the fp32 route agrees with torch to fp32 rounding
(~1e-5 relative); the bf16 one is closer to the exact result than torch's bf16 route, which rounds the logits and
the probabilities to bf16 (tests/test_cpu_attention.py states both tolerances).

Each variant is checked against the torch reference the first time it loads, in both dtypes, on a decode step and
a chunk; one that disagrees is never used.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from .. import ops, reference
from . import routes

FLOATS = (torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# the most new tokens a call takes: its logits (G x Q rows over the slots and the Q new tokens) are kept whole, one
# (sequence, KV head) row at a time; a longer chunk keeps the torch route (a prompt's chunks are 512 tokens)
MAX_NEW_TOKENS = 512


def _checked(library):
    # the bare cffi function: its tensors go as addresses (csrc/attention_api.h), no per-argument casts
    kernel = (library.h2ochat_attend_tokens.function, functools.cache(library.h2ochat_attend_workspace))
    return kernel if all(_agrees_in(kernel, dtype) for dtype in FLOATS) else None


def _loaded() -> tuple[object | None, str]:
    """(the bound kernel of the route that runs here, "") or (None, why none does). ``auto`` never takes the
    generic variant (``variants.Variant.in_auto``): it runs only when named."""
    variant, why = routes.cpu_route("attention")
    return (None, why) if variant is None else routes.cpu_checked("attention", _checked, variant)


ROUTE_SWITCH = "H2OCHAT_CPU_ATTENTION"  # "0": the torch backend's CPU steps keep the torch route


def routed() -> bool:
    """Whether a CPU layer's steps go through this kernel where it loads and takes them: yes unless
    ``H2OCHAT_CPU_ATTENTION=0``."""
    return os.environ.get(ROUTE_SWITCH, "1").strip() != "0"


def available() -> bool:
    return _loaded()[0] is not None


def why_not() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    return _loaded()[1]


def variant_name() -> str | None:
    variant, _ = routes.cpu_route("attention")
    return None if variant is None or _loaded()[0] is None else variant.name


def takes(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scores, decay) -> bool:
    """Whether the kernel takes these arguments: shapes, dtypes, strides and devices only (a compiled step decides
    this while tracing, as an eager step does per call)."""
    if query.dim() != 5 or not 1 <= query.shape[3] <= MAX_NEW_TOKENS or not query.is_cpu:
        return False
    batch, heads, _, q_len, dim = query.shape
    dtype = query.dtype
    slots = (batch, heads, cache_keys.shape[2])
    return (dtype in FLOATS and cache_keys.dtype == dtype and cache_values.dtype == dtype and new_keys.dtype == dtype
            and new_values.dtype == dtype and dim <= MAX_HEAD_DIM
            and cache_keys.is_cpu and cache_values.is_cpu and slot_token_index.is_cpu and new_keys.is_cpu
            and new_values.is_cpu and scores.is_cpu
            and cache_keys.shape == cache_values.shape == (*slots, dim)
            and cache_keys.stride(3) == 1 and cache_values.stride(3) == 1
            and new_keys.shape == new_values.shape == (batch, heads, q_len, dim)
            and slot_token_index.dtype == torch.long and slot_token_index.shape == slots
            and scores.dtype == torch.float32 and scores.shape == slots
            and (new_valid is None or (new_valid.dtype == torch.bool and new_valid.numel() == batch * q_len
                                       and new_valid.is_cpu))
            and (not isinstance(decay, torch.Tensor) or (decay.is_floating_point() and decay.is_cpu
                                                          and decay.numel() in (1, batch))))


def attend_with_scores(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scale,
                       scores, decay=1.0, rest=None):
    """``reference.attend_with_scores(query, ..., decay, rest=rest)`` without quant (``scores`` updated in place;
    returns (out [B, Hkv, G, Q, D] in the query's dtype, new_scores [B, Hkv, Q] fp32)), or None where the kernel does
    not take these arguments (``takes``) or does not load here: then nothing is written. Inside a ``torch.compile``
    trace it is the custom op, whose call runs the kernel (or, where the kernel stopped loading since the trace,
    the reference: the same contract); a recall tier's ``rest`` column comes only to eager steps (a compiled step
    has none), so the op does not take it."""
    if not takes(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scores, decay):
        return None
    if torch.compiler.is_compiling():
        if rest is not None:
            return None
        number, rows = (1.0, decay) if isinstance(decay, torch.Tensor) else (float(decay), None)
        return torch.ops.h2ochat.cpu_attend_with_scores(query, cache_keys, cache_values, slot_token_index, new_keys,
                                                        new_values, new_valid, float(scale), scores, number, rows)
    # eager: the kernel itself, not through the op (the dispatcher's round trip costs tens of us a call)
    kernel = _loaded()[0]
    return None if kernel is None else _call(kernel, query, cache_keys, cache_values, slot_token_index, new_keys,
                                             new_values, new_valid, scale, scores, decay, torch.get_num_threads(),
                                             rest)


@ops._op("cpu_attend_with_scores", mutates_args=("scores",))
def _attend_op(query: Tensor, cache_keys: Tensor, cache_values: Tensor, slot_token_index: Tensor, new_keys: Tensor,
               new_values: Tensor, new_valid: Optional[Tensor], scale: float, scores: Tensor, decay: float,
               decay_rows: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The op a compiled step calls (a schema takes no ``float | Tensor``: the decay is a number, or ``decay_rows``
    per sequence). Its outputs are new tensors: an op's outputs may not alias its inputs."""
    decay = decay if decay_rows is None else decay_rows
    kernel = _loaded()[0]
    if kernel is None:
        return reference.attend_with_scores(query, cache_keys, cache_values, slot_token_index, new_keys, new_values,
                                            new_valid, scale, scores, decay)
    return _call(kernel, query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scale,
                 scores, decay, torch.get_num_threads())


@ops._fake("cpu_attend_with_scores")
def _attend_fake(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scale, scores,
                 decay, decay_rows):
    batch, heads, _, q_len, _ = query.shape
    return query.new_empty(query.shape), query.new_empty((batch, heads, q_len), dtype=torch.float32)


def _call(kernel, query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scale, scores,
          decay, threads, rest=None):
    attend, workspace_floats = kernel
    batch, heads, group, q_len, dim = query.shape
    slots = cache_keys.shape[2]
    query, new_keys, new_values = query.contiguous(), new_keys.contiguous(), new_values.contiguous()
    if new_valid is not None:
        new_valid = new_valid.contiguous()
    weights = None  # (a decode step's one row weighs 1; its padding row is the kernel's to skip)
    if q_len > 1:  # each row's weight and the old scores' factor, as the reference has them
        weights = reference.row_weights(new_valid, batch, q_len, decay, query.device)
        weights = None if weights is None else weights.to(torch.float32).contiguous()
        decay = reference.old_score_factor(new_valid, batch, q_len, decay, query.device)
    if isinstance(decay, torch.Tensor):
        decay = decay.to(torch.float32).reshape(-1).expand(batch).contiguous()
    elif float(decay) == 1.0:
        decay = None
    else:
        decay = torch.full((batch,), float(decay), dtype=torch.float32)
    rest_logit = rest_value = None
    if rest is not None:  # [B, Hkv, G, Q] and [B, Hkv, G, Q, D], fp32 as the kernel reads them
        rest_logit = rest[0].to(torch.float32).expand(batch, heads, group, q_len).contiguous()
        rest_value = rest[1].to(torch.float32).expand(batch, heads, group, q_len, dim).contiguous()
    workspace = torch.empty(workspace_floats(batch, heads, group, q_len, slots, dim, threads), dtype=torch.float32)
    out = torch.empty(batch, heads, group, q_len, dim, dtype=query.dtype)
    new_scores = torch.empty(batch, heads, q_len, dtype=torch.float32)
    attend(query.data_ptr(), batch, heads, group, q_len, dim, cache_keys.data_ptr(), *cache_keys.stride()[:3],
           cache_values.data_ptr(), *cache_values.stride()[:3], slots, slot_token_index.data_ptr(),
           *slot_token_index.stride(), new_keys.data_ptr(), new_values.data_ptr(),
           0 if new_valid is None else new_valid.data_ptr(), float(scale), scores.data_ptr(), *scores.stride(),
           0 if decay is None else decay.data_ptr(), 0 if weights is None else weights.data_ptr(),
           0 if rest_logit is None else rest_logit.data_ptr(), 0 if rest_value is None else rest_value.data_ptr(),
           out.data_ptr(), new_scores.data_ptr(), query.element_size(), workspace.data_ptr(), threads)
    return out, new_scores


def _agrees_in(kernel, dtype: torch.dtype) -> bool:
    """A decode step, a chunk of 19 tokens and one of 70 (two blocks of the kernel's 64), each with and without a
    recall tier's rest column: odd sizes (a head dim with a tail, a view with gaps), empty slots, padding, a decay,
    two threads: against the torch reference on the same values in fp32, within the kernel's stated tolerance."""
    return all(_agrees_at(kernel, dtype, q_len, rest) for q_len in (1, 19, 70) for rest in (False, True))


def _agrees_at(kernel, dtype: torch.dtype, q_len: int, with_rest: bool) -> bool:
    generator = torch.Generator().manual_seed(0)
    batch, heads, group, slots, dim = 2, 3, 3, 37, 67
    query = torch.randn(batch, heads, group, q_len, dim, generator=generator).to(dtype)
    store = torch.randn(2, batch, heads, slots + 5, dim + 3, generator=generator).to(dtype)
    keys, values = store[0, :, :, :slots, :dim], store[1, :, :, :slots, :dim]
    index = torch.arange(slots).expand(batch, heads, slots).clone()
    index[0, 1, ::3] = -1
    new_keys, new_values = torch.randn(2, batch, heads, q_len, dim, generator=generator).to(dtype)
    new_valid = torch.ones(batch, q_len, dtype=torch.bool)
    new_valid[1, 0], new_valid[0, 2:q_len:4] = False, False
    scores = torch.rand(batch, heads, slots, generator=generator)
    rest = None
    if with_rest:  # (a row and head with no rest: -inf)
        rest = (torch.randn(batch, heads, group, q_len, generator=generator) + 2.0,
                torch.randn(batch, heads, group, q_len, dim, generator=generator))
        rest[0][1, 2] = float("-inf")
    expected_scores = scores.clone()
    got = _call(kernel, query, keys, values, index, new_keys, new_values, new_valid, 0.125, scores, 0.5, 2, rest)
    floats = [t.float() for t in (query, keys, values)]
    out, new = reference.attend_with_scores(floats[0], floats[1], floats[2], index, new_keys.float(),
                                            new_values.float(), new_valid, 0.125, expected_scores, 0.5, rest=rest)
    return (torch.allclose(got[0].float(), out.to(dtype).float(), rtol=1e-2, atol=1e-2)
            and torch.allclose(got[1], new, rtol=1e-4, atol=1e-6)
            and torch.allclose(scores, expected_scores, rtol=1e-4, atol=1e-6))
