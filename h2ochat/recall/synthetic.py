"""A benchmark's synthetic context for the two-tier cache: the cold tier filled as if N tokens had
been fed.

``H2OCache.assume_seen(tokens, generator)`` leaves each layer's hot slots holding the most recent
tokens with random keys and values; ``fill_cold_tier`` then hands every older token (token indices
0 .. tokens - held - 1, where held is the hot slots filled) to each layer's cold store and device
digest (``RecallTier.take_cold``), in token order, as the policy would have evicted them (a
decode step's cost does not depend on which tokens were evicted, only on how many the cold tier
holds). Random keys and values are drawn where the digest lives, by ``generator``.
"""

from __future__ import annotations

import torch


def fill_cold_tier(cache, tokens: int, generator: torch.Generator) -> None:
    """After ``cache.assume_seen(tokens, generator)`` on a cache with a recall tier: every layer's cold store
    and digest hold the ``tokens - held`` tokens its hot slots do not (per sequence and KV head)."""
    with torch.inference_mode():
        for layer in cache.layers:
            batch, heads, _, head_dim = layer.keys.shape
            value_dim = layer.values.shape[-1]
            held = int(layer.slots_in_use)
            cold = tokens - held
            if cold <= 0:
                continue
            device, dtype = layer.keys.device, layer.keys.dtype
            keys = torch.randn((batch, heads, cold, head_dim), generator=generator, device=device, dtype=dtype)
            values = torch.randn((batch, heads, cold, value_dim), generator=generator, device=device, dtype=dtype)
            numbers = torch.arange(cold, device=device).expand(batch, heads, cold)
            layer.tier.take_cold(keys, values, numbers, numbers)  # positions: absolute, the token index
