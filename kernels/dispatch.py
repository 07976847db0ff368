"""Choose, per call, the Triton kernel or its torch reference."""

from __future__ import annotations

import os

import torch

from . import reference


def kernel_backend(device: torch.device) -> str:
    """'triton' or 'torch' for tensors on ``device``, honouring H2OCHAT_KERNELS."""
    wanted = os.environ.get("H2OCHAT_KERNELS", "auto").lower()
    if wanted == "torch":
        return "torch"
    if wanted == "triton":
        return "triton"
    return "torch"  # the Triton path plugs in here (issue: Triton kernels)


def attend_with_scores(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scale, scores):
    return reference.attend_with_scores(
        query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scale, scores
    )


def evict_and_insert(priority, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score, new_token_index, new_position):
    return reference.evict_and_insert(
        priority, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score, new_token_index, new_position
    )
