"""A benchmark's synthetic context (``H2OCache.assume_seen``): a decode step costs the same whatever
the values it reads, so a layer can be made to look as if it had been fed a text."""

from __future__ import annotations

import torch


def fill_recent(layer, tokens: int, generator: torch.Generator) -> None:
    """Make ``layer`` (allocated) hold the most recent ``min(capacity, tokens)`` of ``tokens`` tokens
    in every row, with random keys, values (in the slots' format) and scores drawn by ``generator``
    (on the slots' device), and the host counters to match."""
    device = layer.keys.device
    held = min(layer.capacity, tokens)
    batch, heads = layer.keys.shape[:2]
    shape = (batch, heads, held)
    fresh = layer.format.encode(torch.randn((*shape, layer.format.head_dim), generator=generator, device=device),
                                torch.randn((*shape, layer.format.value_dim), generator=generator, device=device))
    numbers = torch.arange(tokens - held, tokens, device=device).expand(batch, heads, held)
    scores = torch.rand((batch, heads, held), generator=generator, device=device)
    layer.write_columns(held, {**fresh, "token_index": numbers, "positions": numbers, "scores": scores})
    layer.set_host_counters(held, tokens)
