"""The decode step compiled with ``torch.compile``: one token per row through the model and its cache.

``CompiledDecode(model)(cache, tokens)`` is ``forward_step.EagerDecode(model)(cache, tokens)`` (the same
logits)
as one compiled graph (inductor; on CUDA ``mode="reduce-overhead"``, i.e. CUDA graphs). Prefill
stays eager: its chunks change shape, and it runs once per prompt.

What keeps the graphs few, each traced once, without a graph break (``fullgraph=True``) and without a
recompile per step:

- a caller that runs several batch sizes (``graphs`` > 1: a server's buckets, views of one batch cache's
  first rows) gets, on the CPU, a batch that turns dynamic at its second size (dynamo's automatic dynamic
  shapes, in a function of its own, ``_decode_any_batch``): one graph for one row and one for every
  other row count, where one graph per bucket cost minutes of C++ compilation each (a 26-row server's six
  buckets: past ten minutes), and a step through the dynamic graph is no slower than a static one
  (docs/results.md: compiled steps). Every other caller compiles static shapes only
  (``dynamic=False``: a recall tier's stores are not fit for symbolic sizes), and so does CUDA, whose
  graphs record one per shape anyway;

- static shapes: the cache is switched to ``static_shapes`` (every step attends over all C slots,
  empty ones masked by their token index, and evicts one slot per (sequence, KV head) in place), so
  a growing cache and a full one run the same graph;
- nothing that changes per step is a Python value inside the graph: the step's token indices and
  position ids are handed out before it (``cache.position_ids``, eager, where the cache's host
  counter decides on a re-numbering) and come in as tensors, and so does the step's row mask
  (``active``: rows that write nothing; always a tensor for a cache that takes one, all True when
  the caller gives none, so a step with and one without a mask are the same graph), and the step runs inside
  ``with cache.compiled_decode():``, which leaves the layers' host counters (slots in use, columns
  fed) to its exit and answers transformers' size queries with a constant (the h2o mask function
  and our position ids ignore them);
- no host read inside the step (no ``.item()``, no branch on a tensor's value).

In place: the eviction writes the new token with ``index_put_`` (``H2OLayer._overwrite_lowest``),
which inductor keeps in place, and inductor's ``reorder_for_locality`` pass is off: it would move
the attention's read of the value slots after that write, forcing a copy of the whole K/V buffer
out and back every step.

A bf16 model's packed linears (``engine.packed_linears``) stay packed in the graph, as the opaque op
``h2ochat::packed_linear``: SmolLM2-135M's one-row step, bf16, one thread, 400 slots, 41.5 -> ~31-33 ms
against plain linears (``aten::mm`` reorders each weight on every call).

Frozen weights on the CPU, opt in (``H2OCHAT_COMPILE_FREEZE=1``): inductor's ``freezing`` takes the
plain weights as constants of the graph and packs them for oneDNN's matrix products. Measured side by side
(SmolLM2-135M, bf16, one thread, `bench --context 1024 --compile`), a frozen step was about 2% faster than an
unfrozen one, while each frozen graph holds its own packed copy of the weights. Not worth a copy of the weights by default; where it
is switched on, a step freezes only when the free memory holds ``graphs`` more copies with as much again to
spare (``freezes_weights``).

Caches the step does not cover run the eager forward instead (``H2OCache.compile_blocker`` says
why): the ``full`` policy (its slots grow), ``random`` (a seeded generator draws on the host), a batch
mixing row policies (eval), and the bench's slots-only ring before it is full.
"""

from __future__ import annotations

import torch

from ..kv import H2OCache
from .packed_linears import unpack_linears, weight_bytes
from .forward_step import EagerDecode, require_h2o_attention
from ..host_memory import free_host_bytes
from ..model_shape import cache_argument

# one compiled graph per (model class, batch, slots, dtype, device, variant): a bench over several
# contexts and batches needs more than dynamo's default of 8 per function
RECOMPILE_LIMIT = 64
FREEZE_SWITCH = "H2OCHAT_COMPILE_FREEZE"  # "1": freeze the weights into the CPU graph (off by default)
BACKEND = "inductor"  # tests use "aot_eager": the same capture (fullgraph, guards, functionalised mutations), no codegen


def unsupported(cache: H2OCache) -> str | None:
    """Why ``cache`` cannot take the compiled step, or None when it can."""
    return cache.compile_blocker()


def freezes_weights(model, device: torch.device, graphs: int = 1) -> tuple[bool, str]:
    """Whether the compiled step on ``device`` takes ``model``'s weights as constants (inductor's
    freezing), and why: CPU only, switched on, and room for ``graphs`` packed copies twice over."""
    import os

    if device.type != "cpu":
        return False, "not on the CPU"
    if os.environ.get(FREEZE_SWITCH, "0") != "1":
        return False, f"weights not frozen ({FREEZE_SWITCH}=1 freezes them)"
    needed = 2 * graphs * weight_bytes(model)
    free = free_host_bytes()
    if free < needed:
        return False, f"{free / 2**30:.1f} GiB free, {needed / 2**30:.1f} GiB wanted for {graphs} frozen copies"
    return True, f"frozen: {graphs} packed copies of the weights"


def _decode_any_batch(model, cache, argument: str, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``_decode`` under a code object of its own: dynamo keeps graphs and its automatic-dynamic state per
    code object, so the server's dynamic-batch graphs stay apart from every static one."""
    return _decode(model, cache, argument, input_ids, position_ids)


def _decode(model, cache, argument: str, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=1,
                h2o_cache=cache, **{argument: cache})
    return out.logits[:, -1]


class CompiledDecode:
    """A compiled decode step for ``model``; call it with a cache and the tokens to feed [B] or [B, 1].

    Compiled graphs live with the function (dynamo's cache), not with this object: a new
    ``CompiledDecode`` for the same model and shapes (a new turn, a new cache) reuses them.
    """

    def __init__(self, model, *, mode: str | None = "auto", backend: str | None = None, graphs: int = 1):
        """``graphs``: how many batch shapes the caller will run (a server's buckets); more than one makes
        the batch dynamic on the CPU (two graphs in all). Each frozen graph holds a copy of the weights,
        counted before freezing them."""
        require_h2o_attention(model)
        self.model = model
        self.eager = EagerDecode(model)
        self.device = next(model.parameters()).device
        backend = backend or BACKEND
        if mode == "auto":
            mode = "reduce-overhead" if self.device.type == "cuda" and backend == "inductor" else None
        self.mode, self.backend = mode, backend
        self.argument = cache_argument(model)
        self.dynamic_batch = graphs > 1 and self.device.type == "cpu"
        self.graphs = 2 if self.dynamic_batch else graphs  # the graphs it builds: one row, and the rest
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        options = None
        if backend == "inductor":
            # inductor's locality pass moves the attention's read of the value slots after the
            # eviction's write to them, which then cannot stay in place: the whole buffer would be
            # copied out and back every step (mode= and options= exclude each other: the mode's options)
            from torch._inductor import list_mode_options

            options = {**list_mode_options(mode or "default"), "reorder_for_locality": False}
            self.frozen, self.freezing = freezes_weights(model, self.device, self.graphs)
            if self.frozen:  # freezing packs the plain weights itself, as constants of the graph
                unpack_linears(model)
                options["freezing"] = True
            mode = None
        else:
            self.frozen, self.freezing = False, f"backend {backend}"
        step = _decode_any_batch if self.dynamic_batch else _decode
        # dynamic None: static shapes until a second batch size makes the batch symbolic
        self.step = torch.compile(step, fullgraph=True, dynamic=None if self.dynamic_batch else False,
                                  backend=backend, mode=mode, options=options)

    @property
    def shapes(self) -> str:
        """The graphs it builds, in words (the server's loading line)."""
        if self.dynamic_batch:
            return "a graph for one row, one for more"
        return "one graph" if self.graphs == 1 else "a graph per batch size"

    def prepare(self, cache: H2OCache) -> bool:
        """Switch ``cache`` to static shapes for the compiled step; False when it cannot take it."""
        if unsupported(cache) is not None:
            return False
        cache.use_static_shapes()
        if self.mode == "reduce-overhead":  # CUDA graphs replay fixed addresses
            cache.mark_static_addresses()
        return True

    def __call__(self, cache: H2OCache, tokens: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token per row (``tokens`` [B] or [B, 1]); returns the next-token logits [B, V].
        ``active`` [B] bool: the rows that are False write nothing (see ``H2OCache.position_ids``)."""
        input_ids = tokens.view(-1, 1)
        if not cache.initialized or not self.prepare(cache):
            return self.eager(cache, input_ids, active)
        batch = input_ids.shape[0]
        if active is None and cache.masks_inactive_rows:  # one graph whether a mask is given or not
            active = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
        # may re-number the cache first (compact positions): eager, and reads no device value
        position_ids = cache.position_ids(batch, 1, active=active)
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with cache.compiled_decode(), torch.inference_mode():
            logits = self.step(self.model, cache, self.argument, input_ids, position_ids)
        # a CUDA graph's output buffer is overwritten by its next replay
        return logits.clone() if self.mode == "reduce-overhead" else logits
