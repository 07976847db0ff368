"""What a cache holds and did, in figures: the bytes of its slots and bookkeeping, what a full cache
would hold, evictions, per-layer statistics, the tier's figures and which tokens are still held.
``H2OCache`` takes these from ``CacheAccounting``; every view (the status line, /cache, --json,
/metrics) reads them, none computes its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerStats:
    capacity: int  # slots allocated per (sequence, head)
    held: float  # tokens held, averaged over sequences and heads
    recent: float  # of which protected (recent window and sinks)
    heavy: float  # of which kept on merit
    evicted: int  # tokens dropped, summed over sequences and heads
    evicted_share: float  # mean share of its (sequence, head)'s score mass a token held when dropped
    heavy_age_median: float | None  # age in tokens of the tokens kept on merit
    heavy_age_oldest: int | None


def layer_stats(layer, tokens_fed: torch.Tensor, grows: bool = False) -> LayerStats:
    """One ``H2OLayer``'s figures, over every device slot column, when each row has been fed
    ``tokens_fed`` [B] (``grows``: a full cache's layer, which keeps nothing on merit): ``capacity``
    counts the tier's columns too (the budget), so ``held`` (the policy's tokens and the tier's)
    never exceeds it."""
    if not layer.is_initialized:
        return LayerStats(layer.columns, 0.0, 0.0, 0.0, 0, 0.0, None, None)
    valid = layer.token_index >= 0
    kept_on_merit = valid & ~layer.protected(tokens_fed - 1) if not grows else valid & False
    held = valid.sum(-1).float().mean().item()
    heavy = kept_on_merit.sum(-1).float().mean().item()
    evicted = int(layer.evicted.sum().item())
    share = float(layer.evicted_share.sum().item()) / evicted if evicted else 0.0
    ages = (tokens_fed.view(-1, 1, 1) - layer.token_index)[kept_on_merit].float()
    median = float(ages.median().item()) if ages.numel() else None
    oldest = int(ages.max().item()) if ages.numel() else None
    return LayerStats(layer.columns, held, held - heavy, heavy, evicted, share, median, oldest)


class CacheAccounting:
    """The figures of an ``H2OCache`` (``layers``, ``tier``, ``tokens_fed``): reads only."""

    def kv_bytes(self) -> int:
        """Bytes of key and value slots actually allocated (codes, scales and offsets when quantized)."""
        return sum(t.numel() * t.element_size()
                   for layer in self.layers if layer.is_initialized for t in layer.slot_view().values())

    def kv_bytes_per_slot(self) -> int | None:
        """Device bytes one slot costs a row in every layer, over its KV heads (keys, values and
        their scales): what one more held token costs (None before the first allocation)."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        return sum(layer.slot_bytes() for layer in layers) if layers else None

    def bookkeeping_bytes(self) -> int:
        """Bytes of scores, token indices, positions (and value norms) beside the slots."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                extra = (layer.scores, layer.token_index, layer.positions, layer.value_norm)
                total += sum(t.numel() * t.element_size() for t in extra if t is not None)
        return total

    def full_kv_bytes(self) -> int:
        """Bytes a cache without eviction would hold for the tokens seen so far."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                total += layer.keys.shape[0] * layer.tokens_fed_with_padding * layer.slot_bytes()
        return total

    def longest_row_tokens(self) -> int:
        """Real tokens fed so far to the row that has had the most."""
        return int(self.tokens_fed.max().item()) if self.tokens_fed is not None else 0

    def evicted_tokens(self) -> int:
        """Tokens dropped, summed over layers, sequences and KV heads."""
        return sum(int(layer.evicted.sum().item()) for layer in self.layers if layer.is_initialized)

    def device_slots(self) -> int:
        """Slot columns per (layer, sequence, KV head) of the first layer: the policy's and the tier's."""
        return self.layers[0].columns

    def tier_stats(self):
        """The tier's figures (``recall.tiered.TierStats``; None: no tier). Reads the device."""
        return self.tier.stats(self)

    def tier_host_bytes_per_token(self) -> float:
        """Host bytes one evicted token of one row costs in the tier (0: a tier that keeps none)."""
        per_token = getattr(self.tier, "host_bytes_per_token", None)
        return per_token(self) if per_token is not None else 0.0

    def tier_record(self) -> dict | None:
        """What the tier holds and did, for ``--json`` records and the views (None: no tier)."""
        return self.tier.record(self)

    def layer_stats(self) -> list[LayerStats]:
        return [layer.stats(self.tokens_fed, self.grows) for layer in self.layers]

    def cached_token_share(self, sequence: int = 0) -> torch.Tensor:
        """For each token index of ``sequence`` seen so far, the share of (layer, head) slots that
        still hold it [tokens_seen] (1.0: kept everywhere, 0.0: evicted everywhere)."""
        seen = int(self.tokens_fed[sequence].item()) if self.tokens_fed is not None else 0
        counts = torch.zeros(seen + 1, dtype=torch.float32)
        total = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            tokens = layer.token_index[sequence].flatten().cpu()
            counts += torch.bincount(tokens[tokens >= 0], minlength=seen + 1)[: seen + 1].float()
            total += layer.token_index.shape[1]
        return counts[:seen] / max(total, 1)
