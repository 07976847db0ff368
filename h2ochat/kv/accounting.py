"""What a cache holds and did, in figures: the bytes of its slots and bookkeeping, what a full cache
would hold, evictions, per-layer statistics, the tier's figures and which tokens are still held.
``H2OCache`` takes these from ``CacheAccounting``; every view (the status line, /cache, --json,
/metrics) reads them, none computes its own."""

from __future__ import annotations

import torch

from .layer import LayerStats


class CacheAccounting:
    """The figures of an ``H2OCache`` (``layers``, ``tier``, ``tokens_fed``): reads only."""

    def kv_bytes(self) -> int:
        """Bytes of key and value slots actually allocated."""
        return sum(
            layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            for layer in self.layers
            if layer.is_initialized
        )

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
                batch, heads, _, head_dim = layer.keys.shape
                per_token = heads * (head_dim + layer.values.shape[-1]) * layer.keys.element_size()
                total += batch * layer.tokens_fed_with_padding * per_token
        return total

    def longest_row_tokens(self) -> int:
        """Real tokens fed so far to the row that has had the most."""
        return int(self.tokens_fed.max().item()) if self.tokens_fed is not None else 0

    def evicted_tokens(self) -> int:
        """Tokens dropped, summed over layers, sequences and KV heads."""
        return sum(int(layer.evicted.sum().item()) for layer in self.layers if layer.is_initialized)

    def device_slots(self) -> int:
        """Slot columns per (layer, sequence, KV head) of the first layer: the policy's and the tier's."""
        return self.layers[0].capacity + self.tier.columns

    def tier_stats(self):
        """The tier's figures (``recall.tiered.TierStats``; None: no tier). Reads the device."""
        return self.tier.stats(self)

    def tier_record(self) -> dict | None:
        """What the tier holds and did, for ``--json`` records and the views (None: no tier)."""
        return self.tier.record(self)

    def layer_stats(self) -> list[LayerStats]:
        return [layer.stats() for layer in self.layers]

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
