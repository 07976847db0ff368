"""Attention and eviction kernels for the H2O cache: Triton on CUDA, plain torch elsewhere.

Import name ``h2ochat_kernels`` (the directory is ``kernels/``; the bare name ``kernels`` belongs to
Hugging Face's package of that name, which transformers imports when it finds it).

``H2OCHAT_KERNELS=torch`` forces the torch path, ``=triton`` forces Triton (an error without it),
``auto`` (default) takes Triton for CUDA tensors when it is importable.
"""

from __future__ import annotations

from .dispatch import attend_with_scores, evict_and_insert, kernel_backend

__all__ = ["attend_with_scores", "evict_and_insert", "kernel_backend"]
