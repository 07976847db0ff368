"""The timing baseline of ``h2ochat bench``: the same preallocated slots as an ``H2OCache``, without
scores or a policy (a "slots" cache). Each new token overwrites the oldest slot in place (a ring)
and attention is plain sdpa over the slots, so h2o's time against it is the price of H2O's
bookkeeping. Decode steps only; it is not a cache to generate with.
"""

from __future__ import annotations

import torch

from ..kv import H2OCache, H2OLayer


class SlotsOnlyLayer(H2OLayer):
    def attend(self, query, key, value, new_valid, scale, context) -> torch.Tensor:
        batch, q_heads, q_len, head_dim = query.shape
        if q_len != 1 or new_valid is not None:
            raise ValueError("the slots-only baseline times decode steps only (one token, no padding)")
        step = context.numbers
        if context.compiled or self.slots_in_use == self.capacity:
            # full: the oldest slot, found from the token count on the device (no Python int in a compiled step)
            slot = step.token_index[:1, 0] % self.capacity
            self.keys.index_copy_(2, slot, key)
            self.values.index_copy_(2, slot, value)
        else:
            self.keys[:, :, self.slots_in_use] = key[:, :, 0]
            self.values[:, :, self.slots_in_use] = value[:, :, 0]
        if not context.compiled:  # a compiled step leaves them to H2OCache.compiled_decode
            self.count_decoded()
        # one new token: the G query heads of a KV group are G query rows over the group's keys
        kv_heads = key.shape[1]
        grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
        keys, values = self.keys, self.values
        if self.slots_in_use < self.capacity:
            keys, values = keys[:, :, : self.slots_in_use], values[:, :, : self.slots_in_use]
        out = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, scale=scale)
        return out.unsqueeze(3)


class SlotsOnlyCache(H2OCache):
    """``H2OCache``'s slots without its bookkeeping (see the module's docstring)."""

    layer_type = SlotsOnlyLayer

    def compile_blocker(self) -> str | None:
        if any(layer.slots_in_use < layer.capacity for layer in self.layers):
            return "the slots-only ring is compiled once full"
        return None
