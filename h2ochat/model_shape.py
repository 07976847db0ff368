"""What a model's configuration says about its attention: its position limit, its KV heads and
head size, the dtype of its keys and values, and what its ``forward`` calls the cache. No torch at
import: the option checks run these on a configuration alone, before anything heavy is loaded."""

from __future__ import annotations

import inspect


def max_positions(config) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 2048)


def attention_shape(config) -> tuple[int, int]:
    """(KV heads, head dim) of a model's attention, from its configuration."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def model_dtype(model):
    """The torch dtype a model computes in (its keys and values): its parameters', else its
    configuration's (a configuration alone, before the weights load), else float32."""
    import torch

    parameter = next(model.parameters(), None) if hasattr(model, "parameters") else None
    if parameter is not None:
        return parameter.dtype
    dtype = getattr(model.config, "dtype", None)  # (torch_dtype: deprecated, it warns when read)
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype or "float32"), torch.float32)


class ConfigOnly:
    """A model known by its configuration only (the checks before the weights load)."""

    def __init__(self, config):
        self.config = config


def cache_argument(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache``; use whichever this version takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
