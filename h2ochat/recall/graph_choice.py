"""A compiled CPU decode step's choice of pages, inside its graph, with the step's own queries.

The eager decode step chooses its recall pages with its own queries (``RecallTier.before_attention``).
That choice cannot be traced: it reads the host (the plan, the store's count), the cold store grows
between steps, and each row's cadence is decided on the host. Chosen before the step instead, with
the last step's queries (the "before" rule), it lost held-out keys (38/60 against 43/60 at 128 slots,
the question read as one chunk: ``benchmarks/recall_rows_passkey.py --decode-rule``).

So the compiled step's graph calls one opaque op a layer, ``h2ochat::recall_choose(queries, slots,
layer)``, where the eager step calls the choice. At run time the op is that eager choice itself
(``RecallTier.choose_prepared``: the C ``DecodeChoice`` where it runs), on the tier that prepared
this step (``prepare``, from ``RecallTier.reserve``, eager before the step, with the rows that
choose and the rotary). The tier is found by its layer's index: one graph serves every cache of its
shapes, so the op's arguments name nothing of one cache. The op declares the layer's per-slot
tensors written (``TierPort.slot_tensors``), so the attention after it reads the pages it brought;
inductor hands it the buffers themselves, a functionalising backend (aot_eager, the tests') copies
of them, which the tier brings up to date.

Not on a GPU: a compiled step there would be a CUDA graph, whose replays run no Python, so the compiled
recall step is refused on accelerators (``recall.spec``) and a GPU's eager step chooses in the step as a
CPU's does; only the "before" rule, or a captured graph, chooses before it (``RecallConfig.chooses_before``).
"""

from __future__ import annotations

import weakref

import torch

_PREPARED: dict[int, weakref.ref] = {}  # layer index -> the tier of the cache about to step (weakly held)


def prepare(layer: int, tier) -> None:
    """``tier`` (of layer ``layer``) takes the next compiled step's ``recall_choose`` call."""
    _PREPARED[layer] = weakref.ref(tier)


def choose(queries: torch.Tensor, slots: list[torch.Tensor], layer: int) -> None:
    """In a compiled step: the prepared tier of ``layer`` chooses its pages for ``queries`` [B, H, G, D]."""
    torch.ops.h2ochat.recall_choose(queries, slots, layer)


def _recall_choose(queries: torch.Tensor, slots: list[torch.Tensor], layer: int) -> None:
    tier = _PREPARED[layer]() if layer in _PREPARED else None
    if tier is None:
        raise RuntimeError(f"recall: layer {layer}'s compiled step ran without its tier preparing it")
    tier.choose_prepared(queries, slots)


# the low-level ``Library`` API: ``torch.library.custom_op``'s wrapper (a version bump of every written
# tensor, an aliasing check of the outputs) was ~3.5% of a compiled recall server's CPU, 30 calls a step
# (the step runs under inference mode: no autograd, no version counters to keep)
_LIBRARY = torch.library.Library("h2ochat", "FRAGMENT")
_LIBRARY.define("recall_choose(Tensor queries, Tensor(a!)[] slots, int layer) -> ()")
_LIBRARY.impl("recall_choose", _recall_choose, "CompositeExplicitAutograd")
torch.library.register_fake("h2ochat::recall_choose", lambda queries, slots, layer: None, lib=_LIBRARY)
