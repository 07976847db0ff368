"""The Triton launchers as ``torch.library`` custom ops, so ``torch.compile`` sees each one as one
opaque node with declared in-place writes.

Ops (namespace ``h2ochat``; ``torch.ops.h2ochat.<name>``):

- ``decode_attend``    ``triton_decode.decode_attend_with_scores`` (Q == 1): writes ``scores``;
- ``chunk_attend``     ``triton_chunk.chunk_attend_with_scores`` (Q > 1, with its old-score decay
  launch when decay != 1): writes ``scores``; both attention ops end with a quantised cache's
  ``QuantSlots`` as seven arguments with defaults (bits, 0 for float slots; the four scale/offset
  tensors or None; the key and value dims);
- ``evict_and_insert`` ``triton_evict.evict_and_insert`` (a priority given);
- ``evict_by_policy``  ``triton_evict.evict_by_policy`` (the priority from the policy's parameters);
  both evictions write ``keys``, ``values``, ``scores``, ``slot_token_index``, ``slot_position``
  and ``value_norm`` (when given) in place, except in the rows an ``active`` mask ([B] bool, last
  argument, None: every row) leaves out (a finished row of a burst of decode steps). The attention
  ops take such a row as ``new_valid`` False: a padding token, which changes no score;
- ``page_scores``      ``triton_recall.page_scores``: the recall digest's page scores (writes nothing).

Why ops and not plain calls under ``torch.compile``: dynamo would otherwise trace the launch code
(environment reads, launch plans, the device guard, the kernels' own Python launcher), which breaks
the graph or bakes host values into it; a custom op is one node whose fake implementation gives
the output shapes, and whose declared mutations let AOT autograd functionalise the in-place writes
(inductor then writes them back in place; CUDA graphs see ordinary kernels on fixed buffers).
``triton_op`` / ``wrap_triton`` are not used: they trace the launch code (which is what is avoided
here) and refuse the Triton interpreter's kernels, so the CPU tests could not run them.

A schema takes no ``float | Tensor``: a decay, a recent window or a sink count that is a number or a
per-sequence tensor travels as two arguments (the number, and the tensor or None).

Eager calls go straight to the launcher: dispatching through the op costs about 17 us per call on
this CPU (21 us against 4 us with the launcher stubbed out), paid per layer per token; only a
``torch.compile`` trace calls the op. This module imports no triton: the launchers are imported on
the first call.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

NAMESPACE = "h2ochat"
_EVICTION_WRITES = ("keys", "values", "scores", "slot_token_index", "slot_position", "value_norm")
_LIBRARY = torch.library.Library(NAMESPACE, "DEF")


def _op(name: str, mutates_args: tuple[str, ...]):
    """Register the decorated launcher call as ``h2ochat::<name>``, its schema inferred from the
    annotations with ``mutates_args`` written in place; returns the function unchanged.

    The low-level ``Library`` API rather than ``torch.library.custom_op``: the latter's wrapper fills
    the schema's defaults in Python on every call, which for these 13-19 arguments cost ~250 us per
    call (measured with the launcher stubbed out), paid wherever a compiled graph calls the op
    without a CUDA-graph replay. Nothing here needs what it adds (autograd, version counters of
    tensors that require grad: the cache's never do)."""
    def register(fn):
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        return fn
    return register


def _fake(name: str):
    """Register the decorated function as ``h2ochat::<name>``'s fake implementation."""
    def register(fn):
        torch.library.register_fake(f"{NAMESPACE}::{name}", fn, lib=_LIBRARY)
        return fn
    return register


def _split(value):
    """(number, tensor or None) for a parameter that is a number or a per-sequence tensor."""
    if isinstance(value, Tensor):
        return (0.0 if value.is_floating_point() else 0), value
    return value, None


def _join(number, rows: Optional[Tensor]):
    return number if rows is None else rows


# -- attention ---------------------------------------------------------------------------------------

def _quant_split(quant) -> tuple:
    """A ``quant.QuantSlots`` (or None) as the ops' trailing arguments: bits (0: float slots), the
    key scale, key offset, value scale and value offset, and the key and value dims."""
    if quant is None:
        return 0, None, None, None, None, 0, 0
    return (int(quant.bits), quant.key_scale, quant.key_offset, quant.value_scale, quant.value_offset,
            int(quant.key_dim), int(quant.value_dim))


def _quant_join(bits, key_scale, key_offset, value_scale, value_offset, key_dim, value_dim):
    from .quant import QuantSlots

    return None if bits == 0 else QuantSlots(bits, key_scale, key_offset, value_scale, value_offset, key_dim, value_dim)


@_op("decode_attend", mutates_args=("scores",))
def _decode_attend(query: Tensor, cache_keys: Tensor, cache_values: Tensor, slot_token_index: Tensor,
                   new_keys: Tensor, new_values: Tensor, new_valid: Optional[Tensor], scale: float, scores: Tensor,
                   decay: float, decay_rows: Optional[Tensor], quant_bits: int = 0,
                   key_scale: Optional[Tensor] = None, key_offset: Optional[Tensor] = None,
                   value_scale: Optional[Tensor] = None, value_offset: Optional[Tensor] = None, key_dim: int = 0,
                   value_dim: int = 0) -> tuple[Tensor, Tensor]:
    from . import triton_decode

    quant = _quant_join(quant_bits, key_scale, key_offset, value_scale, value_offset, key_dim, value_dim)
    return triton_decode.decode_attend_with_scores(query, cache_keys, cache_values, slot_token_index, new_keys,
                                                   new_values, new_valid, scale, scores,
                                                   decay=_join(decay, decay_rows), quant=quant)


@_op("chunk_attend", mutates_args=("scores",))
def _chunk_attend(query: Tensor, cache_keys: Tensor, cache_values: Tensor, slot_token_index: Tensor,
                  new_keys: Tensor, new_values: Tensor, new_valid: Optional[Tensor], scale: float, scores: Tensor,
                  decay: float, decay_rows: Optional[Tensor], quant_bits: int = 0,
                  key_scale: Optional[Tensor] = None, key_offset: Optional[Tensor] = None,
                  value_scale: Optional[Tensor] = None, value_offset: Optional[Tensor] = None, key_dim: int = 0,
                  value_dim: int = 0) -> tuple[Tensor, Tensor]:
    from . import triton_chunk

    quant = _quant_join(quant_bits, key_scale, key_offset, value_scale, value_offset, key_dim, value_dim)
    return triton_chunk.chunk_attend_with_scores(query, cache_keys, cache_values, slot_token_index, new_keys,
                                                 new_values, new_valid, scale, scores, decay=_join(decay, decay_rows),
                                                 quant=quant)


@_fake("decode_attend")
@_fake("chunk_attend")
def _attention_fake(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scale, scores,
                    decay, decay_rows, *quant):
    batch, kv_heads, _, q_len, _ = query.shape
    # both launchers allocate contiguous outputs: the output in the query's dtype, fp32 new scores
    return query.new_empty(query.shape), query.new_empty((batch, kv_heads, q_len), dtype=torch.float32)


def attend_with_scores(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scale, scores,
                       decay=1.0, quant=None):
    """The Triton attention (decode kernel for Q == 1, chunk kernel otherwise): the launcher when
    eager, the op under ``torch.compile``. ``quant``: ``quant.QuantSlots`` for int8 / int4 slots."""
    decay_number, decay_rows = _split(decay)
    if query.shape[3] == 1:
        op, module, launcher = torch.ops.h2ochat.decode_attend, "triton_decode", "decode_attend_with_scores"
    else:
        op, module, launcher = torch.ops.h2ochat.chunk_attend, "triton_chunk", "chunk_attend_with_scores"
    if torch.compiler.is_compiling():
        return op(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, float(scale),
                  scores, float(decay_number), decay_rows, *_quant_split(quant))
    if quant is None:  # (the launcher's own call as before: spies in the tests take no quant)
        return _launcher(module, launcher)(query, cache_keys, cache_values, slot_token_index, new_keys, new_values,
                                           new_valid, scale, scores, decay=decay)
    return _launcher(module, launcher)(query, cache_keys, cache_values, slot_token_index, new_keys, new_values,
                                       new_valid, scale, scores, decay=decay, quant=quant)


def _launcher(module: str, name: str):
    """The launcher looked up on every call (tests replace them with spies)."""
    import importlib

    return getattr(importlib.import_module(f"h2ochat_kernels.{module}"), name)


# -- eviction ----------------------------------------------------------------------------------------

@_op("evict_and_insert", mutates_args=_EVICTION_WRITES)
def _evict_and_insert(priority: Tensor, keys: Tensor, values: Tensor, scores: Tensor, slot_token_index: Tensor,
                      slot_position: Tensor, new_key: Tensor, new_value: Tensor, new_score: Tensor,
                      new_token_index: Tensor, new_position: Tensor, value_norm: Optional[Tensor],
                      new_value_norm: Optional[Tensor], active: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    from . import triton_evict

    return triton_evict.evict_and_insert(priority, keys, values, scores, slot_token_index, slot_position, new_key,
                                         new_value, new_score, new_token_index, new_position, value_norm,
                                         new_value_norm, active)


@_op("evict_by_policy", mutates_args=_EVICTION_WRITES)
def _evict_by_policy(keys: Tensor, values: Tensor, scores: Tensor, slot_token_index: Tensor, slot_position: Tensor,
                     new_key: Tensor, new_value: Tensor, new_score: Tensor, new_token_index: Tensor,
                     new_position: Tensor, value_norm: Optional[Tensor], new_value_norm: Optional[Tensor],
                     recent: int, recent_rows: Optional[Tensor], sinks: int, sinks_rows: Optional[Tensor],
                     oldest_first: bool, by_age: bool, value_eps: Optional[float],
                     active: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    from . import triton_evict

    return triton_evict.evict_by_policy(keys, values, scores, slot_token_index, slot_position, new_key, new_value,
                                        new_score, new_token_index, new_position, value_norm, new_value_norm, active,
                                        recent=_join(recent, recent_rows), sinks=_join(sinks, sinks_rows),
                                        oldest_first=oldest_first, by_age=by_age, value_eps=value_eps)


def _dropped_fake(keys):
    """What an eviction returns: the token index and the score each (sequence, head) dropped."""
    shape = keys.shape[:2]
    return keys.new_empty(shape, dtype=torch.int64), keys.new_empty(shape, dtype=torch.float32)


@_fake("evict_and_insert")
def _evict_and_insert_fake(priority, keys, *rest):
    return _dropped_fake(keys)


@_fake("evict_by_policy")
def _evict_by_policy_fake(keys, *rest):
    return _dropped_fake(keys)


def evict_and_insert(priority, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                     new_token_index, new_position, value_norm=None, new_value_norm=None, active=None):
    """The Triton given-priority eviction: the launcher when eager, the op under ``torch.compile``."""
    args = (priority, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
            new_token_index, new_position, value_norm, new_value_norm, active)
    if torch.compiler.is_compiling():
        return torch.ops.h2ochat.evict_and_insert(*args)
    return _launcher("triton_evict", "evict_and_insert")(*args)


def evict_by_policy(keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                    new_token_index, new_position, value_norm=None, new_value_norm=None, active=None, *, recent,
                    sinks, oldest_first=False, by_age=False, value_eps=None):
    """The Triton policy eviction: the launcher when eager, the op under ``torch.compile``."""
    args = (keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score, new_token_index,
            new_position, value_norm, new_value_norm)
    if torch.compiler.is_compiling():
        return torch.ops.h2ochat.evict_by_policy(
            *args, *_split(recent), *_split(sinks), bool(oldest_first), bool(by_age),
            None if value_eps is None else float(value_eps), active)
    return _launcher("triton_evict", "evict_by_policy")(*args, active, recent=recent, sinks=sinks,
                                                        oldest_first=oldest_first, by_age=by_age, value_eps=value_eps)


# -- recall page scores ------------------------------------------------------------------------------

@_op("page_scores", mutates_args=())
def _page_scores(queries: Tensor, codes: Tensor, scale: Optional[Tensor], offset: Optional[Tensor], valid: Tensor,
                 page: int, bits: Optional[int]) -> Tensor:
    from . import triton_recall

    return triton_recall.page_scores(queries, codes, scale, offset, valid, page, bits)


@_fake("page_scores")
def _page_scores_fake(queries, codes, scale, offset, valid, page, bits):
    batch, heads, tokens, _ = codes.shape
    return codes.new_empty((batch, heads, tokens // page), dtype=torch.float32)


def page_scores(queries, codes, scale, offset, valid, page, bits=None):
    """The Triton page scoring (``recall_reference.page_scores``'s contract): the launcher when eager,
    the op under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return torch.ops.h2ochat.page_scores(queries, codes, scale, offset, valid, int(page), bits)
    return _launcher("triton_recall", "page_scores")(queries, codes, scale, offset, valid, page, bits)


OPS = ("decode_attend", "chunk_attend", "evict_and_insert", "evict_by_policy", "page_scores")
