"""A transformers Cache with a fixed number of preallocated KV slots per layer, evicting by policy.

Each layer holds, per (sequence, KV head), C slots of keys and values plus, per slot, the fp32
accumulated attention score, the token's index in the conversation (-1: empty or padding) and the
position id it was encoded at. A step with Q new tokens runs attention over the occupied slots plus
the new tokens (see ``h2ochat_kernels.attend_with_scores``), adds the attention each token received
to its score, then keeps C of the candidates: the R most recent, and the policy's best among the
rest. Memory never grows past C slots (the ``full`` policy grows instead and never evicts).

The model reaches a layer through ``update`` (called by every attention module just before its
attention function): it parks the new keys and values there and the registered ``h2o`` attention
function picks them up (see ``attention.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import h2ochat_kernels as kernels

from .policies import Policy, SlotBudget, keep_priority
from .rotary import Rotary, rotate_keys

_handoff = threading.local()


class PositionLimitError(RuntimeError):
    """The next tokens would need positions the model was not trained for."""


def take_pending_layer(key: torch.Tensor) -> "H2OLayer | None":
    """The layer whose ``update`` just received ``key``, if any (consumed once)."""
    layer = getattr(_handoff, "layer", None)
    _handoff.layer = None
    if layer is None or layer.pending_key is not key:
        return None
    return layer


@dataclass
class LayerStats:
    capacity: int  # slots allocated per (sequence, head)
    held: float  # tokens held, averaged over sequences and heads
    recent: float  # of which in the protected recent window (or sinks)
    heavy: float  # of which kept on merit
    evicted: int  # tokens dropped, summed over sequences and heads
    score_mass: float  # accumulated attention held in the cache, averaged per (sequence, head)


class H2OLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "H2OCache"):
        super().__init__()
        self.owner = owner
        self.capacity = owner.budget.slots
        self.used = 0  # slot columns in use (the same for every sequence and head)
        self.seen = 0  # tokens fed so far, padding included
        self.pending_key = self.pending_value = None

    # -- transformers' layer interface -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, head_dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        shape = (batch, heads, self.capacity)
        self.keys = key_states.new_zeros(*shape, head_dim)
        self.values = value_states.new_zeros(*shape, value_states.shape[-1])
        self.scores = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.token_index = torch.full(shape, -1, dtype=torch.long, device=self.device)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=self.device)
        self.real_seen = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.evicted = torch.zeros(batch, heads, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending_key, self.pending_value = key_states, value_states
        _handoff.layer = self
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.used + query_length, self.seen - self.used

    def get_max_length(self) -> int:
        return -1 if not self.owner.budget.evicts else self.capacity

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.used = self.seen = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported by the H2O cache")

    # -- the step -----------------------------------------------------------------------------
    def attend(self, query, key, value, new_valid, scale) -> torch.Tensor:
        """Attention for Q new tokens, then scoring and eviction. Returns [B, Hkv, G, Q, D]."""
        self.pending_key = self.pending_value = None
        batch, q_heads, q_len, head_dim = query.shape
        kv_heads = key.shape[1]
        if not self.owner.budget.evicts and self.used + q_len > self.capacity:
            self._grow(self.used + q_len)
        grouped = query.view(batch, kv_heads, q_heads // kv_heads, q_len, head_dim)
        used = self.used
        out, new_scores = kernels.attend_with_scores(
            grouped,
            self.keys[:, :, :used],
            self.values[:, :, :used],
            self.token_index[:, :, :used],
            key,
            value,
            new_valid,
            scale,
            self.scores[:, :, :used],
        )
        self._insert(key, value, new_scores, new_valid)
        return out

    def _new_token_indices(self, new_valid, q_len):
        """Token index and position id of each new token [B, Q] (-1 for padding), and the count of
        real tokens per sequence [B]."""
        if new_valid is None:
            offsets = torch.arange(q_len, device=self.device).expand(self.real_seen.shape[0], q_len)
            counts = torch.full_like(self.real_seen, q_len)
        else:
            offsets = new_valid.long().cumsum(dim=1) - 1
            counts = new_valid.sum(dim=1)
        token_index = self.real_seen.unsqueeze(1) + offsets
        positions = self.next_position.unsqueeze(1) + offsets
        if new_valid is not None:
            token_index = token_index.masked_fill(~new_valid, -1)
            positions = positions.masked_fill(~new_valid, -1)
        return token_index, positions, counts

    def _insert(self, key, value, new_scores, new_valid) -> None:
        q_len = key.shape[2]
        token_index, positions, counts = self._new_token_indices(new_valid, q_len)
        self._place(key, value, new_scores, new_valid, token_index, positions)
        self.real_seen += counts
        self.next_position += counts
        self.seen += q_len

    def _place(self, key, value, new_scores, new_valid, token_index, positions) -> None:
        """Write the new tokens into free slots, or keep the best of slots + new tokens."""
        q_len = key.shape[2]
        used, capacity = self.used, self.capacity
        if used + q_len <= capacity:
            end = used + q_len
            self.keys[:, :, used:end] = key
            self.values[:, :, used:end] = value
            self.scores[:, :, used:end] = new_scores
            self.token_index[:, :, used:end] = token_index.unsqueeze(1)
            self.positions[:, :, used:end] = positions.unsqueeze(1)
            self.used = end
        elif q_len == 1 and new_valid is None:
            self._evict_one(key, value, new_scores, token_index[:, 0], positions[:, 0])
        else:
            self._select(key, value, new_scores, token_index, positions)

    def _priority(self, scores, token_index, newest):
        owner = self.owner
        return keep_priority(owner.policy, owner.budget, scores, token_index, newest, owner.generator)

    def _evict_one(self, key, value, new_score, token_index, position) -> None:
        """Steady decoding: overwrite the lowest-priority slot of each (sequence, head) in place."""
        priority = self._priority(self.scores, self.token_index, token_index)
        dropped = kernels.evict_and_insert(
            priority, self.keys, self.values, self.scores, self.token_index, self.positions,
            key, value, new_score[:, :, 0], token_index, position,
        )
        self.evicted += dropped >= 0

    def _select(self, key, value, new_scores, token_index, positions) -> None:
        """Several new tokens (a prefill chunk, or padding): keep the best C of slots + new."""
        batch, heads, q_len, head_dim = key.shape
        used, capacity = self.used, self.capacity
        expand = (batch, heads, q_len)
        cand_keys = torch.cat([self.keys[:, :, :used], key], dim=2)
        cand_values = torch.cat([self.values[:, :, :used], value], dim=2)
        cand_scores = torch.cat([self.scores[:, :, :used], new_scores], dim=2)
        cand_tokens = torch.cat([self.token_index[:, :, :used], token_index.unsqueeze(1).expand(expand)], dim=2)
        cand_positions = torch.cat([self.positions[:, :, :used], positions.unsqueeze(1).expand(expand)], dim=2)
        newest = torch.maximum(self.real_seen - 1, token_index.max(dim=1).values)
        keep = self._priority(cand_scores, cand_tokens, newest).topk(capacity, dim=-1).indices
        keep = keep.sort(dim=-1).values
        rows = keep.unsqueeze(-1)
        self.keys[:, :, :capacity] = cand_keys.gather(2, rows.expand(-1, -1, -1, head_dim))
        self.values[:, :, :capacity] = cand_values.gather(2, rows.expand(-1, -1, -1, cand_values.shape[-1]))
        self.scores[:, :, :capacity] = cand_scores.gather(2, keep)
        kept_tokens = cand_tokens.gather(2, keep)
        self.token_index[:, :, :capacity] = kept_tokens
        self.positions[:, :, :capacity] = cand_positions.gather(2, keep)
        self.evicted += (cand_tokens >= 0).sum(-1) - (kept_tokens >= 0).sum(-1)
        self.used = capacity

    def _grow(self, needed: int) -> None:
        """The full policy: reallocate to at least ``needed`` slots (doubling, so growth is rare)."""
        capacity = max(needed, 2 * self.capacity)
        extra = capacity - self.capacity

        def widen(tensor, fill):
            pad = tensor.new_full((*tensor.shape[:2], extra, *tensor.shape[3:]), fill)
            return torch.cat([tensor, pad], dim=2)

        self.keys, self.values = widen(self.keys, 0), widen(self.values, 0)
        self.scores = widen(self.scores, 0)
        self.token_index, self.positions = widen(self.token_index, -1), widen(self.positions, -1)
        self.capacity = capacity

    # -- positions ------------------------------------------------------------------------------
    def renumber(self, rotary: Rotary | None) -> None:
        """Give each (sequence, head)'s cached tokens the positions 0..n-1 in their order."""
        valid = self.token_index >= 0
        order = self.positions.masked_fill(~valid, torch.iinfo(torch.long).max)
        rank = order.argsort(dim=-1, stable=True).argsort(dim=-1)
        new_positions = rank.masked_fill(~valid, -1)
        if rotary is not None:
            delta = (new_positions - self.positions).masked_fill(~valid, 0)
            rotate_keys(self.keys, delta, rotary)
        self.positions = new_positions
        self.next_position = valid[:, 0].sum(dim=-1)

    # -- statistics -----------------------------------------------------------------------------
    def stats(self) -> LayerStats:
        if not self.is_initialized:
            return LayerStats(self.capacity, 0.0, 0.0, 0.0, 0, 0.0)
        budget = self.owner.budget
        valid = self.token_index >= 0
        newest = (self.real_seen - 1).view(-1, 1, 1)
        protected = valid & ((self.token_index > newest - budget.recent) | (self.token_index < budget.sinks))
        held = valid.sum(-1).float().mean().item()
        recent = protected.sum(-1).float().mean().item()
        mass = self.scores.masked_fill(~valid, 0).sum(-1).mean().item()
        return LayerStats(self.capacity, held, recent, held - recent, int(self.evicted.sum().item()), mass)


class H2OCache(Cache):
    """Fixed-budget KV cache for a whole model; pass it to ``model(...)`` or ``generate(cache=...)``.

    positions: "compact" re-numbers cached tokens 0..n-1 (rotating RoPE keys to match) whenever the
    next token would pass the model's position limit; "absolute" keeps the positions tokens were
    encoded at and refuses to go past the limit (the paper's behaviour).
    """

    def __init__(
        self,
        num_layers: int,
        policy: Policy,
        budget: SlotBudget,
        *,
        max_positions: int,
        positions: str = "compact",
        rotary: Rotary | None = None,
        seed: int | None = None,
    ):
        if positions not in ("compact", "absolute"):
            raise ValueError(f"positions must be 'compact' or 'absolute', got {positions!r}")
        self.policy, self.budget = policy, budget
        self.max_positions, self.position_mode, self.rotary = max_positions, positions, rotary
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.compactions = 0
        super().__init__(layers=[H2OLayer(self) for _ in range(num_layers)])

    # -- what the generation loop asks -----------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return bool(self.layers) and self.layers[0].is_initialized

    def position_ids(self, batch: int, q_len: int, new_valid: torch.Tensor | None = None, device=None) -> torch.Tensor:
        """Position ids [B, Q] for the next Q tokens, re-numbering the cache first when they
        would pass the model's limit (compact mode)."""
        if self.initialized:
            start = self.layers[0].next_position
        else:
            start = torch.zeros(batch, dtype=torch.long, device=device)
        longest = int(start.max().item()) + q_len
        if longest > self.max_positions:
            start = self._make_room(q_len)
        if new_valid is None:
            offsets = torch.arange(q_len, device=start.device).expand(batch, q_len)
        else:  # real tokens count on from the last one; padding borrows its neighbour's position
            offsets = (new_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        return start.unsqueeze(1) + offsets

    def _make_room(self, q_len: int) -> torch.Tensor:
        if self.position_mode == "absolute":
            raise PositionLimitError(
                f"the conversation reached the model's {self.max_positions}-position limit "
                "(use --positions compact to keep going)"
            )
        if not self.budget.evicts:
            raise PositionLimitError(
                f"the full cache reached the model's {self.max_positions}-position limit; "
                "pick a policy that evicts to keep going"
            )
        if self.budget.slots + q_len > self.max_positions:
            raise PositionLimitError(
                f"{self.budget.slots} slots + {q_len} new tokens do not fit in {self.max_positions} positions"
            )
        with torch.inference_mode():  # the slots were made under inference mode
            for layer in self.layers:
                if layer.is_initialized:
                    layer.renumber(self.rotary)
        self.compactions += 1
        return self.layers[0].next_position

    # -- accounting ------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of key and value slots actually allocated."""
        return sum(
            layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            for layer in self.layers
            if layer.is_initialized
        )

    def bookkeeping_bytes(self) -> int:
        """Bytes of scores, token indices and positions beside the slots."""
        return sum(
            sum(t.numel() * t.element_size() for t in (layer.scores, layer.token_index, layer.positions))
            for layer in self.layers
            if layer.is_initialized
        )

    def full_kv_bytes(self) -> int:
        """Bytes a cache without eviction would hold for the tokens seen so far."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                batch, heads, _, head_dim = layer.keys.shape
                per_token = heads * (head_dim + layer.values.shape[-1]) * layer.keys.element_size()
                total += batch * layer.seen * per_token
        return total

    def tokens_seen(self) -> int:
        """Real tokens fed so far in the longest sequence."""
        return int(self.layers[0].real_seen.max().item()) if self.initialized else 0

    def evicted_tokens(self) -> int:
        """Tokens dropped, summed over layers, sequences and KV heads."""
        return sum(int(layer.evicted.sum().item()) for layer in self.layers if layer.is_initialized)

    def layer_stats(self) -> list[LayerStats]:
        return [layer.stats() for layer in self.layers]

    def cached_token_share(self, sequence: int = 0) -> torch.Tensor:
        """For each token index of ``sequence`` seen so far, the share of (layer, head) slots that
        still hold it [tokens_seen] (1.0: kept everywhere, 0.0: evicted everywhere)."""
        seen = int(self.layers[0].real_seen[sequence].item()) if self.initialized else 0
        counts = torch.zeros(seen + 1, dtype=torch.float32)
        total = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            tokens = layer.token_index[sequence].flatten().cpu()
            counts += torch.bincount(tokens[tokens >= 0], minlength=seen + 1)[: seen + 1].float()
            total += layer.token_index.shape[1]
        return counts[:seen] / max(total, 1)
