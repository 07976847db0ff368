"""A benchmark's synthetic context for the two-tier cache: the cold tier filled as if N tokens had
been fed.

``H2OCache.assume_seen(tokens, generator)`` leaves each layer's hot slots holding the most recent
tokens with random keys and values; ``fill_cold_tier`` then hands every older token (token indices
0 .. tokens - held - 1, where held is the hot slots filled) to each layer's cold store and device
digest (``RecallTier.take_cold``), in token order, as the policy would have evicted them (a
decode step's cost does not depend on which tokens were evicted, only on how many the cold tier
holds). Random keys and values are drawn where the digest lives, by ``generator``.

``append_rows`` fills a bare cold store (and digest) with a different number of tokens in each row, as a
server's batch holds them: what the host-memory test and ``benchmarks/recall_row_memory.py`` measure.
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


def append_rows(store, rows_tokens: list[int], generator: torch.Generator, digest=None, chunk: int = 512) -> None:
    """Each row of the cold store ``store`` (and ``digest``, a ``KeyCodes``) given its number of evicted tokens
    (random keys and values at the store's dtype; positions = token indices), ``chunk`` at a time, so the
    stores grow as a served batch's do."""
    batch, heads = store.count.shape
    done = [0] * batch
    while any(d < n for d, n in zip(done, rows_tokens)):
        take = [min(chunk, n - d) for d, n in zip(done, rows_tokens)]
        index = torch.full((batch, heads, max(take)), -1, dtype=torch.long)
        for row, count in enumerate(take):
            index[row, :, :count] = torch.arange(done[row], done[row] + count)
        shape = (*index.shape, store.keys.shape[-1])
        keys = torch.randn(shape, generator=generator, dtype=store.dtype)
        store.append(keys, torch.randn(shape, generator=generator, dtype=store.dtype), index, index)
        if digest is not None:
            digest.append(keys, index)
        done = [d + t for d, t in zip(done, take)]
