"""Attention and eviction kernels for the H2O cache: Triton on CUDA, plain torch elsewhere.

Import name ``h2ochat_kernels`` (the directory is ``kernels/``; the bare name ``kernels`` belongs to
Hugging Face's package of that name, which transformers imports when it finds it).

``H2OCHAT_KERNELS=torch`` forces the torch path, ``=triton`` forces Triton (an error without it),
``auto`` (default) takes Triton for CUDA tensors when it is importable.

Modules: ``reference`` (the semantics, plain torch), ``dispatch`` (the choice), ``triton_decode``
(Q == 1, split-S flash decoding with scores), ``triton_chunk`` (Q > 1, two-pass prefill with column
scores), ``triton_evict`` (one-launch argmin + overwrite). The triton modules are imported only on
the first Triton call. On the CPU they run only under TRITON_INTERPRET=1 set before triton is first
imported (tests/test_kernels.py shows how).
"""

from __future__ import annotations

from .dispatch import attend_with_scores, evict_and_insert, evict_by_policy, kernel_backend
from .reference import keep_priority, protected_slots, slot_rank, token_age

__all__ = [
    "attend_with_scores", "evict_and_insert", "evict_by_policy", "kernel_backend",
    "keep_priority", "protected_slots", "slot_rank", "token_age",
]
