"""A transformers Cache with a fixed number of preallocated KV slots per layer, evicting by policy.

Each layer holds, per (sequence, KV head), C slots of keys and values plus, per slot, the fp32
score, the token's index in the conversation (-1: empty or padding), the position id it was encoded
at and, for policies that rank by it, the norm of its value. A step with Q new tokens runs attention
over the occupied slots plus the new tokens (see ``h2ochat_kernels.attend_with_scores``), updates
the scores as the policy says (S <- decay * S + attention), then keeps C of the candidates: the
protected ones (recent window, sinks) and the policy's best among the rest. Memory never grows
past C slots (the ``full`` policy grows instead and never evicts).

How the model reaches a layer: every attention module calls ``cache.update(k, v, layer_idx)`` just
before its attention function. ``update`` records the new keys as pending and the registered
``h2o`` attention function (attention.py) attends them through ``H2OLayer.attend``. A pending step
nobody attended (the model runs another attention implementation) raises at the next ``update``.

Positions and token indices have one source: the cache numbers each step's new tokens once
(``H2OCache.position_ids``) and every layer records exactly those numbers; a re-numbering maps each
row's held tokens to new positions as a function of their old ones, so every layer and head agrees.

One cache can serve a batch whose rows follow different policies and budgets (``H2OCache.for_rows``,
used by ``h2ochat eval``): each layer then allocates the largest row's slots, and a row with fewer
slots leaves its spare ones unused once it holds its own number of tokens, so it evicts exactly as
a cache of its own size would.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import h2ochat_kernels as kernels

from .policies import Policy, SlotBudget, get_policy
from .rotary import Rotary, rotate_keys

# GPT-NeoX calls ``update`` without the keyword arguments it later gives the attention function, so
# under transformers' own generate() the attention function finds its layer here (the only case).
_last_update = threading.local()


class PositionLimitError(RuntimeError):
    """The next tokens would need positions the model was not trained for."""


class AttentionMismatchError(RuntimeError):
    """The H2OCache was driven by something other than the ``h2o`` attention function."""


@dataclass(frozen=True)
class RowSpec:
    """One row of a mixed batch: its policy, its slots per layer and its random seed."""

    policy: Policy
    slots: int
    seed: int | None = None


class CacheShapeError(RuntimeError):
    """A row state that does not fit the cache it is imported into (a programming error)."""


@dataclass
class RowState:
    """One batch row's whole cache state (every layer), normally on the host: what a server parks
    between requests, or moves from a 1-row prefill cache into a row of a batch cache.

    ``layers[i]`` holds layer i's ``H2OLayer.state_tensors()`` for this row: keys/values [Hkv, C, D];
    scores, token_index, positions, value_norm (if the policy uses it) [Hkv, C]; evicted,
    evicted_share [Hkv]. ``counters``: the row's ``tokens_fed`` and ``next_position`` (0-d), shared
    by all layers."""

    layers: list[dict[str, torch.Tensor]]
    counters: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        tensors = [*(t for layer in self.layers for t in layer.values()), *self.counters.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def tokens_fed(self) -> int:
        """Real tokens this row has been fed."""
        return int(self.counters["tokens_fed"])


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


class H2OLayer(CacheLayerMixin):
    """One layer's slots. Counters: ``slots_in_use`` (slot columns holding a token or padding, the
    same for every row and head) and ``tokens_fed_with_padding`` (columns fed, padding included) are
    host ints; the per-row counts of real tokens and positions live in the cache (``H2OCache.tokens_fed``,
    ``H2OCache.next_position``), one source for every layer."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "H2OCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.budgets = owner.row_budgets(layer_idx)  # one per row group
        self.capacity = max(budget.slots for budget in self.budgets)
        self.slots_in_use = 0
        self.tokens_fed_with_padding = 0
        self.pending_key = self.pending_value = None

    @property
    def budget(self) -> SlotBudget:
        """This layer's share-out (the first row's, for a mixed batch)."""
        return self.budgets[0]

    # -- transformers' layer interface -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, head_dim = key_states.shape
        self.allocate(batch, heads, head_dim, value_states.shape[-1], key_states.dtype, key_states.device)

    def allocate(self, batch: int, heads: int, head_dim: int, value_dim: int, dtype, device) -> None:
        """Empty slots for ``batch`` rows of ``heads`` KV heads (what the first ``update`` does), and
        the eviction route for this device and policy, chosen once here."""
        self.device, self.dtype = torch.device(device), dtype
        shape = (batch, heads, self.capacity)
        self.keys = torch.zeros(*shape, head_dim, dtype=dtype, device=self.device)
        self.values = torch.zeros(*shape, value_dim, dtype=dtype, device=self.device)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.value_norm = (torch.zeros(shape, dtype=torch.float32, device=self.device)
                           if self.owner.uses_value_norm else None)
        self.token_index = torch.full(shape, -1, dtype=torch.long, device=self.device)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=self.device)
        self.evicted = torch.zeros(batch, heads, dtype=torch.long, device=self.device)
        self.evicted_share = torch.zeros(batch, heads, dtype=torch.float32, device=self.device)
        # (sequence, head) coordinates of a per-(sequence, head) slot index, for in-place writes
        self.batch_rows = torch.arange(batch, device=self.device).view(-1, 1)
        self.head_columns = torch.arange(heads, device=self.device).view(1, -1)
        self.rows = self.owner.row_parameters(self.layer_idx, batch, self.device)
        self.evictor = self._choose_eviction()
        self.slots_in_use = self.tokens_fed_with_padding = 0
        self.owner.counters_for(batch, self.device)
        self.is_initialized = True

    def _choose_eviction(self):
        """The steady-state eviction for this layer's device and policy (H2OCHAT_KERNELS is read here,
        once): the torch rules, Triton's one launch from the policy's parameters, or Triton's
        eviction of a priority computed in torch (per-row policies, rows of different budgets)."""
        if kernels.kernel_backend(self.device) == "torch":
            return self._evict_by_torch_priority
        if self.owner.fused_eviction_parameters is not None and not self.rows.spare_slots:
            return self._evict_fused
        return self._evict_by_kernel_priority

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this layer updates in place, by name (first dimension: the batch row). A
        compiled step's CUDA graph reads and writes exactly these; ``H2OCache.export_row`` copies them."""
        if not self.is_initialized:
            return {}
        names = ("keys", "values", "scores", "token_index", "positions", "value_norm", "evicted", "evicted_share")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def reset_row(self, row: int) -> None:
        """Empty batch row ``row`` (no tokens, scores and counters 0), leaving the other rows alone."""
        for name, tensor in self.state_tensors().items():
            tensor[row] = -1 if name in ("token_index", "positions") else 0

    def update(self, key_states, value_states, *args, kwargs: dict | None = None, **_):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending_key, self.pending_value = key_states, value_states
        if isinstance(kwargs, dict):  # OPT and Llama hand this same dict to the attention function
            kwargs["h2o_layer"] = self
        _last_update.layer = self
        return key_states, value_states

    def get_seq_length(self) -> int:
        # inside a compiled decode step nothing uses the answer (positions come from the cache, the
        # h2o mask function ignores sizes): a constant keeps the per-step counter out of the graph's guards
        return self.capacity if self.owner.compiled_step else self.tokens_fed_with_padding

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.owner.compiled_step:
            return self.capacity + query_length, 0
        return self.slots_in_use + query_length, self.tokens_fed_with_padding - self.slots_in_use

    def get_max_length(self) -> int:
        return -1 if not self.owner.evicts else self.capacity

    def reset(self) -> None:
        """Drop the slots (their memory goes back): the layer allocates again on its next update."""
        self.is_initialized = False
        for name in ("keys", "values", "scores", "token_index", "positions", "value_norm", "evicted", "evicted_share"):
            setattr(self, name, None)
        self.slots_in_use = self.tokens_fed_with_padding = 0
        self.pending_key = self.pending_value = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported by the H2O cache")

    # -- the step -----------------------------------------------------------------------------
    def take_pending(self, key: torch.Tensor) -> None:
        """The attention picks up the keys ``update`` recorded: they must be the same tensor."""
        if key is not self.pending_key:
            raise AttentionMismatchError(
                f"layer {self.layer_idx}: the keys given to the attention are not the ones cache.update received "
                "(a forward hook or a copy between them?); the H2O cache would attend the wrong tokens"
            )
        self.pending_key = self.pending_value = None
        self.owner.pending = None

    def attend(self, query, key, value, new_valid, scale) -> torch.Tensor:
        """Attention for Q new tokens, then scoring and eviction. Returns [B, Hkv, G, Q, D]."""
        self.take_pending(key)
        batch, q_heads, q_len, head_dim = query.shape
        kv_heads = key.shape[1]
        step = self.owner.step_numbers(self.layer_idx, batch, q_len, new_valid, query.device)
        # a row left out of a decode step (``StepNumbers.active``) is a padding token to the attention:
        # it changes no score (no decay either)
        attend_valid = new_valid if step.active is None else step.active.view(batch, 1)
        if self.owner.grows and self.slots_in_use + q_len > self.capacity:
            self._grow(self.slots_in_use + q_len)
        grouped = query.view(batch, kv_heads, q_heads // kv_heads, q_len, head_dim)
        slots = (self.keys, self.values, self.token_index, self.scores)
        if not self.owner.static_shapes and self.slots_in_use < self.capacity:
            slots = tuple(tensor[:, :, : self.slots_in_use] for tensor in slots)
        cache_keys, cache_values, token_index, scores = slots
        out, new_scores = kernels.attend_with_scores(
            grouped, cache_keys, cache_values, token_index, key, value, attend_valid, scale, scores, self.rows.decay)
        self._insert(key, value, new_scores, new_valid, step)
        return out

    def _insert(self, key, value, new_scores, new_valid, step: "StepNumbers") -> None:
        q_len = key.shape[2]
        value_norm = value.float().norm(dim=-1) if self.value_norm is not None else None
        decoding = q_len == 1 and new_valid is None
        # (static_shapes is read first: a compiled step must not read, hence guard on, slots_in_use)
        if decoding and (self.owner.static_shapes or self.slots_in_use == self.capacity or self.rows.spare_slots):
            # steady state: the lowest-priority slot of each (sequence, head) is overwritten in place;
            # an empty slot ranks lowest, so a cache that is not full yet fills its next slot
            # (the mask goes only where there is one: wrappers of evict_one may not take it)
            self.evict_one(key, value, new_scores[:, :, 0], step.token_index[:, 0], step.positions[:, 0],
                           value_norm[:, :, 0] if value_norm is not None else None,
                           **({} if step.active is None else {"active": step.active}))
            if not self.owner.compiled_step:  # a compiled step leaves them to H2OCache.compiled_decode
                self.count_decoded()
            return
        used, capacity = self.slots_in_use, self.capacity
        if self.rows.spare_slots and not decoding and used + q_len > self.rows.smallest_slots:
            raise ValueError("a multi-token step must fit every row's budget (the opening chunk only)")
        if used + q_len <= capacity:
            end = used + q_len
            writes = [(self.keys, key), (self.values, value), (self.scores, new_scores),
                      (self.token_index, step.token_index.unsqueeze(1)), (self.positions, step.positions.unsqueeze(1))]
            if value_norm is not None:
                writes.append((self.value_norm, value_norm))
            for buffer, new in writes:
                part = buffer[:, :, used:end]
                if step.active is not None:  # a row left out keeps what its column holds
                    new = torch.where(step.active.view(-1, *([1] * (part.dim() - 1))), new, part)
                part.copy_(new.expand_as(part))
            self.slots_in_use = end
        else:
            self._select(key, value, new_scores, step.token_index, step.positions, value_norm)
        self.tokens_fed_with_padding += q_len

    def count_decoded(self) -> None:
        """The host counters after one decode step (one token per row, evicted in place)."""
        self.slots_in_use = min(self.slots_in_use + 1, self.capacity)
        self.tokens_fed_with_padding += 1

    def priority(self, scores, token_index, newest, value_norm) -> torch.Tensor:
        """Keep priority [B, Hkv, S] of every slot (higher = keep): each row by its policy."""
        rank = self.owner.rank(scores, token_index, newest, value_norm, self.rows)
        priority = kernels.keep_priority(rank, token_index, newest, self.rows.recent, self.rows.sinks)
        if self.rows.spare_slots:  # a row holding its own budget leaves the spare slots alone
            full = (token_index >= 0).sum(dim=-1, keepdim=True) >= self.rows.slots.view(-1, 1, 1)
            priority = priority.masked_fill((token_index < 0) & full, float("inf"))
        return priority

    # -- steady decoding: overwrite the lowest-priority slot of each (sequence, head) in place ---------
    def evict_one(self, key, value, new_score, token_index, position, value_norm, active=None) -> None:
        """Put the new token [B, Hkv, 1, D] in place of each (sequence, head)'s lowest-priority slot,
        by the route ``allocate`` chose for this device and policy. ``active`` [B] bool (None: every
        row): a row left out writes nothing and counts no eviction."""
        self.evictor(key, value, new_score, token_index, position, value_norm, active)

    def _evict_by_torch_priority(self, key, value, new_score, token_index, position, value_norm, active=None) -> None:
        """The torch route: the policy's priority (the kernels' rules), then ``_overwrite_lowest``."""
        mass = self.scores.sum(dim=-1)  # before the overwrite (see _count_one_eviction)
        priority = self.priority(self.scores, self.token_index, token_index, self.value_norm)
        # (a subclass's _overwrite_lowest may not take the mask: it only gets it when there is one)
        mask = {} if active is None else {"active": active}
        dropped, dropped_score = self._overwrite_lowest(priority, key, value, new_score, token_index, position,
                                                        value_norm, **mask)
        self._count_one_eviction(dropped, dropped_score, mass)

    def _evict_fused(self, key, value, new_score, token_index, position, value_norm, active=None) -> None:
        """Triton: the policy's rank, the priority, argmin and the overwrite in one launch."""
        mass = self.scores.sum(dim=-1)
        dropped, dropped_score = kernels.evict_by_policy(
            self.keys, self.values, self.scores, self.token_index, self.positions, key, value, new_score, token_index,
            position, self.value_norm, value_norm, active, recent=self.rows.recent, sinks=self.rows.sinks,
            **self.owner.fused_eviction_parameters)
        self._count_one_eviction(dropped, dropped_score, mass)

    def _evict_by_kernel_priority(self, key, value, new_score, token_index, position, value_norm,
                                  active=None) -> None:
        """Triton eviction of a priority computed in torch (per-row policies, or rows of different budgets)."""
        mass = self.scores.sum(dim=-1)
        priority = self.priority(self.scores, self.token_index, token_index, self.value_norm)
        dropped, dropped_score = kernels.evict_and_insert(
            priority, self.keys, self.values, self.scores, self.token_index, self.positions, key, value, new_score,
            token_index, position, self.value_norm, value_norm, active)
        self._count_one_eviction(dropped, dropped_score, mass)

    def _count_one_eviction(self, dropped, dropped_score, mass) -> None:
        """``_count_evictions`` for one slot in fewer ops: scores are >= 0 and empty and padding slots
        hold score 0 (no attention reaches them), so an empty slot dropped held 0 and a (sequence,
        head) of mass 0 dropped 0: neither needs a mask or a branch. A row an active mask left out
        reports dropped -1 and score 0: its counters add 0."""
        self.evicted += dropped >= 0
        self.evicted_share += dropped_score / mass.clamp_min(1e-30)

    def _overwrite_lowest(self, priority, key, value, new_score, token_index, position, value_norm, active=None):
        """``h2ochat_kernels.evict_and_insert`` (the lowest priority of each (sequence, head) goes, ties
        to the lowest slot; returns the token it held and its score) with its writes as index_put_:
        fewer ops, and an update torch.compile keeps in place where it copies a whole scattered buffer.
        A row ``active`` leaves out writes its slot's own content back (the same bits) and reports
        nothing dropped."""
        where = (self.batch_rows, self.head_columns, priority.argmin(dim=-1))  # each (sequence, head)'s slot
        dropped, dropped_score = self.token_index[where], self.scores[where]
        writes = [(self.keys, key[:, :, 0]), (self.values, value[:, :, 0]), (self.scores, new_score),
                  (self.token_index, token_index.view(-1, 1)),  # one per sequence, for all its heads
                  (self.positions, position.view(-1, 1))]
        if self.value_norm is not None:
            writes.append((self.value_norm, value_norm))
        for buffer, new in writes:
            new = new if new.dtype == buffer.dtype else new.to(buffer.dtype)
            if active is not None:
                new = torch.where(active.view(-1, *([1] * (new.dim() - 1))), new, buffer[where])
            buffer.index_put_(where, new)
        if active is not None:
            dropped = dropped.masked_fill(~active.view(-1, 1), -1)
            dropped_score = dropped_score.masked_fill(~active.view(-1, 1), 0.0)
        return dropped, dropped_score

    def _count_evictions(self, evicted: torch.Tensor, dropped_score: torch.Tensor, mass: torch.Tensor) -> None:
        """``evicted`` [B, Hkv] (bool, or a count), ``dropped_score`` their summed score, ``mass`` the
        score mass of the (sequence, head) at that moment."""
        self.evicted += evicted
        self.evicted_share += torch.where(mass > 0, dropped_score / mass.clamp_min(1e-30), 0.0) * (evicted > 0)

    def _select(self, key, value, new_scores, token_index, positions, value_norm) -> None:
        """Several new tokens (a prefill chunk, or padding): keep the best C of slots + new."""
        batch, heads, q_len, head_dim = key.shape
        used, capacity = self.slots_in_use, self.capacity
        expand = (batch, heads, q_len)
        candidates = {
            "keys": torch.cat([self.keys[:, :, :used], key], dim=2),
            "values": torch.cat([self.values[:, :, :used], value], dim=2),
            "scores": torch.cat([self.scores[:, :, :used], new_scores], dim=2),
            "token_index": torch.cat([self.token_index[:, :, :used], token_index.unsqueeze(1).expand(expand)], dim=2),
            "positions": torch.cat([self.positions[:, :, :used], positions.unsqueeze(1).expand(expand)], dim=2),
        }
        if value_norm is not None:
            candidates["value_norm"] = torch.cat([self.value_norm[:, :, :used], value_norm], dim=2)
        newest = self.owner.tokens_fed - 1  # the step's tokens are counted already
        priority = self.priority(candidates["scores"], candidates["token_index"], newest, candidates.get("value_norm"))
        keep = priority.topk(capacity, dim=-1).indices.sort(dim=-1).values
        valid = candidates["token_index"] >= 0
        mass = candidates["scores"].masked_fill(~valid, 0).sum(dim=-1)
        kept_valid = valid.gather(2, keep)
        dropped_score = mass - candidates["scores"].gather(2, keep).masked_fill(~kept_valid, 0).sum(dim=-1)
        for name, candidate in candidates.items():
            index = keep if candidate.dim() == 3 else keep.unsqueeze(-1).expand(-1, -1, -1, candidate.shape[-1])
            getattr(self, name)[:, :, :capacity] = candidate.gather(2, index)
        self._count_evictions(valid.sum(-1) - kept_valid.sum(-1), dropped_score, mass)
        self.slots_in_use = capacity

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
        if self.value_norm is not None:
            self.value_norm = widen(self.value_norm, 0)
        self.capacity = capacity

    # -- statistics -----------------------------------------------------------------------------
    def protected(self, newest: torch.Tensor | None = None) -> torch.Tensor:
        """[B, Hkv, C] bool: the slots the policy never evicts (recent window and sinks) now."""
        newest = self.owner.tokens_fed - 1 if newest is None else newest
        return kernels.protected_slots(self.token_index, newest, self.rows.recent, self.rows.sinks)

    def stats(self) -> LayerStats:
        if not self.is_initialized:
            return LayerStats(self.capacity, 0.0, 0.0, 0.0, 0, 0.0, None, None)
        valid = self.token_index >= 0
        kept_on_merit = valid & ~self.protected() if self.owner.evicts else valid & False
        held = valid.sum(-1).float().mean().item()
        heavy = kept_on_merit.sum(-1).float().mean().item()
        evicted = int(self.evicted.sum().item())
        share = float(self.evicted_share.sum().item()) / evicted if evicted else 0.0
        ages = (self.owner.tokens_fed.view(-1, 1, 1) - self.token_index)[kept_on_merit].float()
        median = float(ages.median().item()) if ages.numel() else None
        oldest = int(ages.max().item()) if ages.numel() else None
        return LayerStats(self.capacity, held, held - heavy, heavy, evicted, share, median, oldest)


@dataclass
class StepNumbers:
    """What one step's new tokens are, handed out once per step by the cache and recorded as is by
    every layer: token index and position [B, Q] (-1 for padding), and the position ids the model
    encodes them at (padding borrows its neighbour's)."""

    token_index: torch.Tensor
    positions: torch.Tensor
    position_ids: torch.Tensor
    # [B] bool for a decode step some rows sit out (None: every row takes part): a row left out writes
    # nothing anywhere and its counters stand still; its token index and position are -1
    active: torch.Tensor | None = None
    last_layer: int = -1  # the deepest layer that has taken them (a shallower one asking starts a new step)


@dataclass(frozen=True)
class HostCounters:
    """The cache's host-side counters at one moment (``H2OCache.host_counters``)."""

    largest_next_position: int
    compactions: int
    layers: tuple[tuple[int, int], ...]  # each layer's (slots_in_use, tokens_fed_with_padding)


@dataclass
class RowParameters:
    """A layer's per-row policy parameters: ints/floats when every row shares them, else [B] tensors."""

    recent: int | torch.Tensor
    sinks: int | torch.Tensor
    decay: float | torch.Tensor
    slots: torch.Tensor | None  # each row's own slots, when some row has fewer than the layer holds
    smallest_slots: int

    @property
    def spare_slots(self) -> bool:
        return self.slots is not None


@dataclass
class Renumbering:
    """A re-numbering of positions as a function of (row, old position), the same for every layer and
    head: a row's distinct held positions, sorted, are numbered by rank (gaps closed); when there are
    more than ``span``, the newest span // 2 keep consecutive numbers and the older ones are squeezed
    into the rest in proportion. A position that was not among the held ones (a token held elsewhere,
    e.g. in a cold tier) takes the number of the first held position after it."""

    distinct: torch.Tensor  # sorted keys row * stride + position over every row's held positions
    first: torch.Tensor  # [B + 1] where each row's keys start in ``distinct``
    stride: int
    span: int

    @classmethod
    def of(cls, batch: int, held: list[tuple[torch.Tensor, torch.Tensor]], span: int) -> "Renumbering":
        """From ``held`` (positions [B, ...], valid [B, ...]) pairs: every layer's slots."""
        device = held[0][0].device
        stride = int(max(int(positions.max()) for positions, _ in held)) + 1
        keys = []
        for positions, valid in held:
            row_base = torch.arange(batch, device=device).view(-1, *([1] * (positions.dim() - 1))) * stride
            keys.append((positions + row_base)[valid])
        distinct = torch.unique(torch.cat(keys))  # sorted
        first = torch.searchsorted(distinct, torch.arange(batch + 1, device=device) * stride)
        return cls(distinct, first, stride, span)

    def _row_shape(self, like: torch.Tensor) -> tuple[int, ...]:
        return (-1, *([1] * (like.dim() - 1)))

    def _widths(self, like: torch.Tensor):
        count = (self.first[1:] - self.first[:-1]).view(self._row_shape(like))  # distinct positions per row
        width = count.clamp(max=self.span)
        return count, width, width // 2

    def apply(self, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """New positions for ``positions`` [B, ...] (-1 where not ``valid``), on the positions' device.
        Old positions past the row's last held one keep their order after it (stride keeps rows apart)."""
        device = positions.device
        distinct, first = self.distinct.to(device), self.first.to(device)
        row_base = torch.arange(positions.shape[0], device=device).view(self._row_shape(positions)) * self.stride
        old = positions.clamp(min=0).clamp(max=self.stride - 1) + row_base
        rank = torch.searchsorted(distinct, old.contiguous()) - first[:-1].view(self._row_shape(positions))
        count, width, newest = (t.to(device) for t in self._widths(positions))
        rank = rank.clamp(max=(count - 1).clamp(min=0))
        squeezed = rank * (width - newest) // (count - newest).clamp(min=1)
        new_positions = torch.where(rank >= count - newest, rank - (count - width), squeezed)
        return new_positions.masked_fill(~valid, -1)

    def next_position(self) -> torch.Tensor:
        """[B]: the position each row's next token gets (one past its newest held token)."""
        count = self.first[1:] - self.first[:-1]
        return count.clamp(max=self.span)


class H2OCache(Cache):
    """Fixed-budget KV cache for a whole model; pass it to ``model(...)`` or ``generate(cache=...)``.

    ``slots`` is the budget per layer (the policy may shape it by depth, keeping the total).
    positions: "compact" re-numbers cached tokens (rotating RoPE keys to match) whenever the next
    tokens would pass the model's position limit; "absolute" keeps the positions tokens were encoded
    at and refuses to go past the limit (the paper's behaviour).
    static_shapes: decode steps attend over all C slots (empty ones masked) and always evict in place,
    so every step has the same shapes (for torch.compile / CUDA graphs).

    Counters, one source each: ``tokens_fed`` [B] (real tokens fed per row; a token's index is its
    count before it), ``next_position`` [B] (the position the next real token of each row gets) and
    ``largest_next_position`` (their maximum, a host int: deciding on a re-numbering reads nothing
    back from the device; after a step that left rows out, an upper bound: see ``position_ids``). A step's token indices and positions are handed out once (``position_ids``,
    or the first layer to attend when nobody asked: transformers' ``generate()``) and every layer
    records exactly those.
    """

    layer_type = H2OLayer

    def __init__(
        self,
        num_layers: int,
        policy: Policy | str,
        slots: int,
        *,
        max_positions: int,
        positions: str = "compact",
        rotary: Rotary | None = None,
        seed: int | None = None,
        static_shapes: bool = False,
        rows: Sequence[RowSpec] | None = None,
    ):
        if positions not in ("compact", "absolute"):
            raise ValueError(f"positions must be 'compact' or 'absolute', got {positions!r}")
        self.policy = get_policy(policy)
        self.slots = slots
        self.row_specs = list(rows) if rows else [RowSpec(self.policy, slots, seed)]
        self.max_positions, self.position_mode, self.rotary = max_positions, positions, rotary
        self.static_shapes = static_shapes
        self.generators = [torch.Generator().manual_seed(r.seed) if r.seed is not None else None for r in self.row_specs]
        self.generator = self.generators[0]
        self.uses_value_norm = any(r.policy.uses_value_norm for r in self.row_specs)
        self.grows = any(r.policy.grows for r in self.row_specs)
        self._layer_budgets = [r.policy.layer_budgets(r.slots, num_layers) for r in self.row_specs]
        # the one-launch eviction's parameters, when every row ranks by the same built-in formula
        # (looked up once, not per layer and step)
        same_rank = len({repr(r.policy.fused_eviction) for r in self.row_specs}) == 1
        self.fused_eviction_parameters = self.policy.fused_eviction if same_rank else None
        super().__init__(layers=[self.layer_type(self, index) for index in range(num_layers)])
        self._clear_counters()

    def _clear_counters(self) -> None:
        """The cache-level state an empty cache starts from (``__init__`` and ``reset``)."""
        self.tokens_fed: torch.Tensor | None = None  # [B] real tokens fed per row
        self.next_position: torch.Tensor | None = None  # [B] the next real token's position per row
        self.largest_next_position = 0
        self.compactions = 0  # re-numberings so far
        self.pending: H2OLayer | None = None  # the layer whose new keys wait for the attention
        self.step: StepNumbers | None = None  # the current step's token indices and positions
        # True inside ``compiled_decode()``: see there which fields it leaves stale
        self.compiled_step = False
        # the slots are marked as fixed addresses for CUDA graphs (h2ochat.compiled); new slots are not
        self.static_addresses_marked = False

    def compile_blocker(self) -> str | None:
        """Why the compiled decode step (``h2ochat.compiled``) cannot take this cache, or None."""
        if self.grows:
            return "the full policy grows its slots (shapes change)"
        if self.mixed:
            return "rows with different policies (eval) rank row by row"
        if self.fused_eviction_parameters is None:
            return f"the {self.policy.name} policy ranks with its own code (e.g. a seeded random draw on the host)"
        return None

    @classmethod
    def for_rows(cls, num_layers: int, rows: Sequence[RowSpec], **kwargs) -> "H2OCache":
        """A cache whose batch row i follows ``rows[i]``'s policy and budget (a ``full`` row gets
        its slots up front: give it as many as the text has tokens)."""
        return cls(num_layers, rows[0].policy, max(r.slots for r in rows), rows=rows, **kwargs)

    # -- the policy, per row ---------------------------------------------------------------------
    @property
    def mixed(self) -> bool:
        return len(self.row_specs) > 1

    @property
    def evicts(self) -> bool:
        return not self.grows

    @property
    def budget(self) -> SlotBudget:
        """The first layer's share-out of the first row (what the UI shows)."""
        return self._layer_budgets[0][0]

    def row_budgets(self, layer_idx: int) -> list[SlotBudget]:
        return [budgets[layer_idx] for budgets in self._layer_budgets]

    def row_parameters(self, layer_idx: int, batch: int, device) -> RowParameters:
        budgets = self.row_budgets(layer_idx)
        if not self.mixed:
            budget = budgets[0]
            return RowParameters(budget.recent, budget.sinks, self.policy.decay, None, budget.slots)
        if len(budgets) != batch:
            raise ValueError(f"the cache has {len(budgets)} row policies but the batch has {batch} rows")

        def per_row(values, dtype):
            if len(set(values)) == 1:
                return values[0]
            return torch.tensor(values, dtype=dtype, device=device)

        slots = [b.slots for b in budgets]
        return RowParameters(
            recent=per_row([b.recent for b in budgets], torch.long),
            sinks=per_row([b.sinks for b in budgets], torch.long),
            decay=per_row([r.policy.decay for r in self.row_specs], torch.float32),
            slots=torch.tensor(slots, device=device) if min(slots) < max(slots) else None,
            smallest_slots=min(slots),
        )

    def rank(self, scores, token_index, newest, value_norm, rows: RowParameters) -> torch.Tensor:
        """Each row's merit by its own policy (rows sharing a policy are ranked together)."""
        if not self.mixed:
            return self.policy.rank(scores, token_index, newest, value_norm, self.generator)
        rank = torch.zeros_like(scores)
        groups: dict[Policy, list[int]] = {}
        for index, spec in enumerate(self.row_specs):
            groups.setdefault(spec.policy, []).append(index)
        for policy, indices in groups.items():
            if policy.fused_eviction is None:  # e.g. random: each row draws as a cache of its own would
                for index in indices:
                    rank[index:index + 1] = self._own_rank(index, scores, token_index, newest, value_norm, rows)
                continue
            idx = torch.tensor(indices, device=scores.device)
            norm = value_norm[idx] if value_norm is not None else None
            rank[idx] = policy.rank(scores[idx], token_index[idx], newest[idx], norm)
        return rank

    def _own_rank(self, index, scores, token_index, newest, value_norm, rows) -> torch.Tensor:
        """Row ``index`` ranked with its own generator, over its own slots only, and only once it
        holds its budget (draws happen when a cache of its own size would evict)."""
        slots = self.row_specs[index].slots if rows.slots is not None else scores.shape[-1]
        own = slice(index, index + 1)
        rank = torch.zeros_like(scores[own])
        if not bool(((token_index[own] >= 0).sum(-1) >= slots).all()):
            return rank
        part = (own, slice(None), slice(0, slots))
        norm = value_norm[part].cpu() if value_norm is not None else None
        drawn = self.row_specs[index].policy.rank(scores[part].cpu(), token_index[part].cpu(), newest[own].cpu(),
                                                  norm, self.generators[index])
        rank[:, :, :slots] = drawn.to(scores.device)
        return rank

    # -- transformers' interface ------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.pending is not None:
            raise AttentionMismatchError(
                f"layer {self.pending.layer_idx}'s new keys never reached the h2o attention: an H2OCache needs the "
                "model loaded with attn_implementation='h2o' (h2ochat.attention.use_h2o_attention(model))"
            )
        self.pending = self.layers[layer_idx]
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        """Empty the cache: every layer's slots are dropped (their memory goes back) and the counters,
        the re-numbering count and any step in progress start over."""
        for layer in self.layers:
            layer.reset()
        self._clear_counters()

    @contextlib.contextmanager
    def compiled_decode(self):
        """The mode of a compiled decode step (``h2ochat.compiled``), one token per row. Inside it the
        layers leave stale what a traced graph must not read as a Python value that changes per step:
        ``H2OLayer.slots_in_use`` and ``tokens_fed_with_padding`` (advanced on a clean exit, as the
        eager step does), and transformers' size queries answer with the capacity
        (``get_seq_length``/``get_mask_sizes``: the h2o mask function and our position ids ignore
        them). The step's token indices and positions must be handed out (``position_ids``) before."""
        self.compiled_step = True
        try:
            yield
        finally:
            self.compiled_step = False
        for layer in self.layers:
            layer.count_decoded()

    # -- one batch row at a time ---------------------------------------------------------------------
    def allocate(self, batch: int, kv_heads: int, head_dim: int, *, dtype, device, value_dim: int | None = None) -> None:
        """Initialise every layer with empty slots for ``batch`` rows, without a forward."""
        self._clear_counters()
        for layer in self.layers:
            layer.allocate(batch, kv_heads, head_dim, value_dim or head_dim, dtype, device)

    def export_row(self, row: int, device="cpu") -> RowState:
        """A copy of batch row ``row``'s state in every layer (on ``device``)."""
        if not self.initialized:
            raise CacheShapeError("the cache holds nothing yet: nothing to export")
        layers = [{name: tensor[row].to(device, copy=True) for name, tensor in layer.state_tensors().items()}
                  for layer in self.layers]
        counters = {name: tensor[row].to(device, copy=True) for name, tensor in self._row_counters().items()}
        return RowState(layers, counters)

    def _row_counters(self) -> dict[str, torch.Tensor]:
        return {"tokens_fed": self.tokens_fed, "next_position": self.next_position}

    def import_row(self, row: int, state: RowState) -> None:
        """Overwrite batch row ``row`` with ``state`` (exported from a cache of the same layer count,
        capacities, heads and dtype), in place: the other rows, mid-generation or not, are untouched
        and a compiled step's buffers keep their addresses. The row then continues exactly as its
        own cache would have (until a re-numbering, which every row of a batch takes together)."""
        if not self.initialized:
            raise CacheShapeError("allocate the cache (H2OCache.allocate) before importing a row into it")
        if len(state.layers) != len(self.layers):
            raise CacheShapeError(f"the row state has {len(state.layers)} layers, the cache {len(self.layers)}")
        targets = [(f"layer {index}", layer.state_tensors(), saved)
                   for index, (layer, saved) in enumerate(zip(self.layers, state.layers))]
        targets.append(("counters", self._row_counters(), state.counters))
        for where, mine, saved in targets:
            if set(saved) != set(mine):
                raise CacheShapeError(f"{where}: the row state holds {sorted(saved)}, the cache {sorted(mine)}")
            for name, tensor in mine.items():
                if saved[name].shape != tensor.shape[1:] or saved[name].dtype != tensor.dtype:
                    raise CacheShapeError(f"{where} {name}: the row state's {tuple(saved[name].shape)} "
                                          f"{saved[name].dtype} does not fit the cache's {tuple(tensor.shape[1:])} "
                                          f"{tensor.dtype}")
        with torch.inference_mode():  # the slots were made under inference mode
            for _, mine, saved in targets:
                for name, tensor in mine.items():
                    tensor[row].copy_(saved[name])
        # the host counters cover every row: slot columns in use and columns fed take the larger
        for layer, saved in zip(self.layers, state.layers):
            occupied = (saved["token_index"] >= 0).any(dim=0).nonzero()
            layer.slots_in_use = max(layer.slots_in_use, int(occupied.max()) + 1 if occupied.numel() else 0)
            layer.tokens_fed_with_padding = max(layer.tokens_fed_with_padding, state.tokens_fed)
        self.largest_next_position = max(self.largest_next_position, int(state.counters["next_position"]))

    def reset_row(self, row: int) -> None:
        """Empty batch row ``row`` (no tokens, scores and counters 0) without touching the others."""
        if not self.initialized:
            return
        with torch.inference_mode():
            for layer in self.layers:
                layer.reset_row(row)
            for tensor in self._row_counters().values():
                tensor[row] = 0
        # one read-back (rows are reset rarely): the bound is the largest next position left
        self.largest_next_position = int(self.next_position.max())

    def assume_seen(self, tokens: int, generator: torch.Generator) -> None:
        """Make an initialised cache look as if every row had been fed ``tokens`` tokens (a benchmark's
        synthetic context: a decode step costs the same whatever the values it reads): each layer
        holds its most recent ``min(capacity, tokens)`` tokens with random keys, values and scores,
        drawn by ``generator`` (on the slots' device)."""
        device = self.layers[0].keys.device
        with torch.inference_mode():
            for layer in self.layers:
                held = min(layer.capacity, tokens)
                batch, heads = layer.keys.shape[:2]
                for buffer in (layer.keys, layer.values):
                    part = buffer[:, :, :held]
                    part.copy_(torch.randn(part.shape, generator=generator, device=device, dtype=part.dtype))
                numbers = torch.arange(tokens - held, tokens, device=device).expand(batch, heads, held)
                layer.token_index[:, :, :held] = numbers
                layer.positions[:, :, :held] = numbers
                layer.scores[:, :, :held] = torch.rand((batch, heads, held), generator=generator, device=device)
                layer.slots_in_use, layer.tokens_fed_with_padding = held, tokens
            self.tokens_fed.fill_(tokens)
            self.next_position.fill_(tokens)
        self.largest_next_position = tokens

    # -- what the generation loop asks -----------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return bool(self.layers) and self.layers[0].is_initialized

    def counters_for(self, batch: int, device) -> None:
        """Allocate the per-row counters for ``batch`` rows, if not yet (the first step, or ``allocate``)."""
        if self.tokens_fed is None or self.tokens_fed.shape[0] != batch:
            self.tokens_fed = torch.zeros(batch, dtype=torch.long, device=device)
            self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
            self.largest_next_position = 0

    def position_ids(self, batch: int, q_len: int, new_valid: torch.Tensor | None = None, device=None,
                     active: torch.Tensor | None = None) -> torch.Tensor:
        """Position ids [B, Q] for the next Q tokens, re-numbering the cache first when they would
        pass the model's limit (compact mode). Every layer records these positions for these tokens.
        Reads nothing back from the device for a step without padding.

        ``active`` [B] bool (a decode step, Q = 1; None: every row): the rows left out sit this step
        out (finished rows of a burst of decode steps, ``generation.stream``): they write nothing in
        any layer (no slot, score, decay or eviction count changes) and their ``tokens_fed`` and
        ``next_position`` stand still; their output is meaningless. Nothing is read back, so the host
        counters (``largest_next_position``, the layers' ``slots_in_use`` and
        ``tokens_fed_with_padding``) advance as if every row took part: upper bounds from then on
        (a re-numbering makes ``largest_next_position`` exact again; ``restore_host_counters`` puts
        back what they were before steps that, it turned out, fed no row at all)."""
        if active is not None and not self.masks_inactive_rows:
            raise ValueError(f"{type(self).__name__} cannot leave rows out of a step (its layers do more than write)")
        if self.largest_next_position + q_len > self.max_positions:
            self._make_room(q_len)
        return self._begin_step(batch, q_len, new_valid, device, active).position_ids

    @property
    def masks_inactive_rows(self) -> bool:
        """Whether a decode step can leave rows out (``position_ids(active=...)``). A subclass whose
        layers do more than write their slots (a cold tier taking evicted tokens) does not, unless it
        says so."""
        return type(self).layer_type is H2OLayer

    def host_counters(self) -> "HostCounters":
        """The host-side counters, to put back with ``restore_host_counters``."""
        return HostCounters(self.largest_next_position, self.compactions,
                            tuple((layer.slots_in_use, layer.tokens_fed_with_padding) for layer in self.layers))

    def restore_host_counters(self, saved: "HostCounters") -> None:
        """Put back the host counters ``saved`` before decode steps that fed no row at all (every row
        was left out: a burst's steps after its last row finished): those steps changed nothing on
        the device, so the counters are exact again. A re-numbering since then keeps its own
        (exact) ``largest_next_position``."""
        if saved.compactions == self.compactions:
            self.largest_next_position = saved.largest_next_position
        for layer, (slots_in_use, fed) in zip(self.layers, saved.layers):
            layer.slots_in_use, layer.tokens_fed_with_padding = slots_in_use, fed

    def step_numbers(self, layer_idx: int, batch: int, q_len: int, new_valid, device) -> StepNumbers:
        """The current step's numbers for layer ``layer_idx``: the ones ``position_ids`` handed out,
        or, for a step nobody asked positions for (transformers' ``generate()`` passes its own
        position ids, a test driving layers by hand), the same numbers made once for all layers."""
        step = self.step
        if step is None or layer_idx <= step.last_layer or step.token_index.shape != (batch, q_len):
            step = self._begin_step(batch, q_len, new_valid, device)
        step.last_layer = layer_idx
        return step

    def _begin_step(self, batch: int, q_len: int, new_valid: torch.Tensor | None, device,
                    active: torch.Tensor | None = None) -> StepNumbers:
        """Number the next Q tokens of every row from the counters, and advance the counters."""
        device = device if device is not None else (self.layers[0].device if self.initialized else "cpu")
        self.counters_for(batch, device)
        with torch.inference_mode():
            if active is not None:  # a decode step some rows sit out: they take -1, like padding
                if q_len != 1 or new_valid is not None:
                    raise ValueError("rows can sit out a decode step only (one token per row, no padding)")
                left_out = ~active.view(batch, 1)
                position_ids = self.next_position.unsqueeze(1).clone()  # (the counter moves on below)
                token_index = self.tokens_fed.unsqueeze(1).masked_fill(left_out, -1)
                positions = position_ids.masked_fill(left_out, -1)
                fed = active.long()
                self.tokens_fed += fed
                self.next_position += fed
                self.largest_next_position += 1  # an upper bound: see position_ids
            elif new_valid is None:
                offsets = torch.arange(q_len, device=device).expand(batch, q_len)
                token_index = self.tokens_fed.unsqueeze(1) + offsets
                positions = position_ids = self.next_position.unsqueeze(1) + offsets
                self.tokens_fed += q_len
                self.next_position += q_len
                self.largest_next_position += q_len
            else:  # real tokens count on from the last one; padding borrows its neighbour's position id
                counted = new_valid.long().cumsum(dim=1)
                offsets = counted - 1
                token_index = (self.tokens_fed.unsqueeze(1) + offsets).masked_fill(~new_valid, -1)
                position_ids = self.next_position.unsqueeze(1) + offsets.clamp(min=0)
                positions = position_ids.masked_fill(~new_valid, -1)
                self.tokens_fed += counted[:, -1]
                self.next_position += counted[:, -1]
                # a step with padding is a prompt chunk, not the decode step: one read-back is fine here
                self.largest_next_position = int(self.next_position.max())
        self.step = StepNumbers(token_index, positions, position_ids, active)
        return self.step

    def _make_room(self, q_len: int) -> None:
        if self.position_mode == "absolute":
            raise PositionLimitError(
                f"the conversation reached the model's {self.max_positions}-position limit "
                "(use --positions compact to keep going)"
            )
        if not self.evicts:
            raise PositionLimitError(
                f"the full cache reached the model's {self.max_positions}-position limit; "
                "pick a policy that evicts to keep going"
            )
        largest = max(layer.capacity for layer in self.layers)
        if largest + q_len > self.max_positions:
            raise PositionLimitError(
                f"{largest} slots + {q_len} new tokens do not fit in {self.max_positions} positions: "
                "a budget of the whole window can never re-number, use a smaller --budget to go past the limit"
            )
        if self.initialized:
            self._renumber(span=min(self.max_positions - q_len, max(largest, self.max_positions // 2)))
        self.compactions += 1

    def _renumber(self, span: int) -> None:
        """Give the tokens held anywhere in a row new positions below ``span``, the same in every layer
        and head (``Renumbering``: by rank among all of the row's held tokens, order kept, gaps
        closed; when a row holds more than ``span`` distinct ones, the newest span // 2 keep
        consecutive positions and the older ones share the rest in proportion). RoPE keys are rotated
        to their new positions; everything is updated in place (a CUDA graph keeps reading the same
        buffers). One read-back per re-numbering."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        with torch.inference_mode():
            renumbering = Renumbering.of(self.tokens_fed.shape[0], [(layer.positions, layer.token_index >= 0)
                                                                     for layer in layers], span)
            self._apply_renumbering(renumbering, layers)
        self.largest_next_position = int(self.next_position.max())

    def _apply_renumbering(self, renumbering: "Renumbering", layers: list[H2OLayer]) -> None:
        """Move every layer's held tokens to their new positions (a subclass holding tokens elsewhere,
        e.g. a cold tier, moves those too, with the same function)."""
        for layer in layers:
            valid = layer.token_index >= 0
            new_positions = renumbering.apply(layer.positions, valid)
            if self.rotary is not None:
                rotate_keys(layer.keys, (new_positions - layer.positions).masked_fill(~valid, 0), self.rotary)
            layer.positions.copy_(new_positions)
        self.next_position.copy_(renumbering.next_position())

    def room_before_renumbering(self) -> int:
        """New tokens that fit before the next re-numbering (prefill caps its chunks to this only
        when a re-numbering is due)."""
        return self.max_positions - self.largest_next_position

    # -- accounting ------------------------------------------------------------------------------
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
