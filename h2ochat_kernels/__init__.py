"""Attention and eviction kernels for the H2O cache: Triton on CUDA, plain torch elsewhere.

The directory bears the import name, ``h2ochat_kernels``: a directory ``kernels/`` at the repository
root is found by transformers' probe for Hugging Face's ``kernels`` package whenever the root is on
``sys.path`` (``python -m pytest`` puts it there) and imported a second time under that name, whose
custom ops then register twice.

``H2OCHAT_KERNELS=torch`` forces the torch path, ``=triton`` forces Triton (an error without it),
``auto`` (default) takes Triton for CUDA tensors when it is importable.

Modules: ``reference`` (the semantics, plain torch: what the CPU runs), ``dispatch`` (the choice:
``backend_for(device)``, the ``Backend`` a cache layer keeps from its allocation on), ``ops`` (the
launchers as ``torch.ops.h2ochat.*`` custom ops, which a ``torch.compile`` trace calls),
``triton_decode`` (Q == 1, split-S flash decoding with scores), ``triton_chunk`` (Q > 1, two-pass
prefill with column scores), ``triton_evict`` (one launch per layer: the priority, from a tensor or from
the policy's parameters, argmin and in-place overwrite), ``recall_reference`` and ``triton_recall`` (the
recall digest's page scores from packed low-bit codes, and the packing), ``_common`` (what the Triton
modules share), ``quant`` (the quantised slots' format: int8 and int4 codes with a float32 scale and
offset per token and KV head; ``attend_with_scores(..., quant=QuantSlots)`` attends such slots), ``rotation`` (the
fixed spreading rotation int4 keys are turned by before the quantiser codes them). The
score decay of ``attend_with_scores`` (S <- decay * S + a_t, a float or one per sequence) runs inside
the decode and chunk kernels, and ``evict_by_policy`` (rank by score, score / age, value norm or token
index; recent window and sinks as ints or per sequence) is one kernel on CUDA.

Every launch is made with the tensors' CUDA device current (``_common.launch_guard``), so layers
spread over GPUs (device_map auto) launch on their own device and its current stream.

The triton modules are imported only on the first Triton call. On the CPU they run only under
TRITON_INTERPRET=1 set before triton is first imported (tests/test_kernels.py shows how; with
TRITON_INTERPRET=0 H2OCHAT_TEST_DEVICE=cuda the same tests run on a GPU).
"""

from __future__ import annotations

from . import quant
from .dispatch import Backend, attend_with_scores, backend_for, evict_and_insert, evict_by_policy, kernel_backend
from .quant import QuantSlots
from .recall_reference import codes_per_byte, pack_codes, packed_width, page_scores, top_pages, unpack_codes
from .reference import keep_priority, protected_slots, slot_rank, token_age
from .rotation import spreading_rotation

__all__ = [
    "Backend", "attend_with_scores", "backend_for", "evict_and_insert", "evict_by_policy", "kernel_backend",
    "keep_priority", "protected_slots", "slot_rank", "token_age", "page_scores", "top_pages",
    "codes_per_byte", "pack_codes", "packed_width", "unpack_codes", "quant", "QuantSlots", "spreading_rotation",
]
