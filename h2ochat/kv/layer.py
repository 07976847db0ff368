"""One layer of the H2O cache: transformers' ``CacheLayerMixin`` over a fixed number of slot columns,
composed of the slots (keys, values and, per slot, the fp32 score, the token's index in the text
(-1: empty or padding), the position it was encoded at and, for policies that rank by it, its
value norm), the policy's per-row parameters (``kv.rows.RowParameters``), a kernel backend chosen
once at allocation (``h2ochat_kernels.Backend``: attention, evictions, page scores) and a tier
(``kv.tier``: none, or recall).

A step with Q new tokens: the tier runs first (``before_attention``), the attention runs over the
occupied slots plus the new tokens (``Backend.attend_with_scores``) and updates the scores as the
policy says (S <- decay * S + attention), then the layer keeps C = ``capacity`` of the candidates: the
protected ones (recent window, sinks) and the policy's best among the rest. A decode step overwrites
each (sequence, head)'s lowest-priority slot in place; a tier that archives sees that victim first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

import h2ochat_kernels as kernels
from h2ochat_kernels import reference

from ..policies import SlotBudget
from .accounting import layer_stats
from .numbering import StepContext
from .full import widened
from .slot_format import SCALE_TENSORS, slot_format

class NoTier:
    """The tier of a plain cache: evicted tokens are gone for good."""

    columns = 0
    archives = False

    def allocate(self, layer, batch, heads, head_dim, value_dim, dtype, device) -> None:
        pass

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def empty_value(self, name: str) -> int:
        return 0

    def reset(self) -> None:
        pass

    def reserve(self, layer, q_len: int, context) -> None:
        pass

    def before_attention(self, layer, query, new_valid, context) -> None:
        pass

    def before_insert(self, layer) -> None:
        pass

    def archive(self, layer, slot) -> None:
        pass

    def archive_dropped(self, layer, candidates, dropped) -> None:
        pass

    def renumber(self, layer, renumbering, rotary) -> None:
        pass

    def export_row(self, row: int, device) -> dict[str, torch.Tensor]:
        return {}

    def import_row(self, row: int, state: dict[str, torch.Tensor]) -> None:
        pass


NO_TIER_LAYER = NoTier()  # stateless: one serves every layer


class LastUpdate(threading.local):
    """The cache whose ``update`` last parked keys in one of its layers, on this thread: how the
    attention function finds its cache under transformers' own generate(), which passes it no
    ``h2o_cache`` (every family calls ``update`` just before its attention)."""

    cache = None
    layer: "H2OLayer | None" = None

    def record(self, cache, layer: "H2OLayer") -> None:
        self.cache, self.layer = cache, layer

    def take(self):
        """The cache recorded, once: None when nothing was, or when its keys were attended already."""
        cache, layer = self.cache, self.layer
        self.cache = self.layer = None
        return cache if layer is not None and layer.pending_key is not None else None


last_update = LastUpdate()

# every per-row tensor a layer keeps of its own (value_norm: None unless the policy ranks by it; the
# scales and offsets: None unless the slots are quantized, ``kv.slot_format``)
SLOT_TENSORS = ("keys", "values", *SCALE_TENSORS, "scores", "token_index", "positions", "value_norm", "evicted",
                "evicted_share")
EMPTY_AS_MINUS_ONE = ("token_index", "positions")  # an empty slot's token index and position; the rest start at 0


class AttentionMismatchError(RuntimeError):
    """The H2OCache was driven by something other than the ``h2o`` attention function."""


@dataclass(frozen=True)
class LayerSetup:
    """What a cache tells each of its layers once, at construction: the rows' policies and budgets
    (``kv.rows.RowPolicies``), the cache's kind (``kv.full``: bounded, or growing) and ``--kv-dtype``.
    Per-step facts come with each step instead (``StepContext``)."""

    row_policies: object  # kv.rows.RowPolicies
    kind: object  # kv.full's cache kind
    kv_dtype: str


class H2OLayer(CacheLayerMixin):
    """One layer: its slots, its policy's parameters (``rows``), its kernels (``kernels``, a
    ``Backend`` chosen once at allocation) and its tier (``tier``, see ``kv.tier``). The policy works
    on the first ``capacity`` slot columns; the tier owns ``tier.columns`` more after them, which the
    policy never ranks. Counters: ``slots_in_use`` (slot columns holding a token or padding, the
    same for every row and head) and ``tokens_fed_with_padding`` (columns fed, padding included) are
    host ints; the per-row counts of real tokens and positions live in the cache (``H2OCache.tokens_fed``,
    ``H2OCache.next_position``), one source for every layer. The layer holds no reference to its
    cache: it is told its setup once (``LayerSetup``) and each step's facts with the step
    (``StepContext``, ``attend``)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, layer_idx: int, setup: LayerSetup, tier):
        super().__init__()
        self.layer_idx, self.setup = layer_idx, setup
        self.row_policies, self.kind = setup.row_policies, setup.kind
        self.fused_eviction_parameters = setup.row_policies.fused_eviction_parameters
        self.budgets = setup.row_policies.budgets(layer_idx)  # one per row group
        self.capacity = max(budget.slots for budget in self.budgets)  # the policy's columns
        self.tier = tier
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
        """Empty slots for ``batch`` rows of ``heads`` KV heads (what the first ``update`` does), the
        kernels and the eviction route for this device and policy, chosen once here, and the tier's
        own state."""
        self.device, self.dtype = torch.device(device), dtype
        self.kernels = kernels.backend_for(self.device)  # H2OCHAT_KERNELS is read here, once
        shape = (batch, heads, self.columns)
        # keys, values (floats, or codes with their scales and offsets): --kv-dtype's format
        self.format = slot_format(self.setup.kv_dtype, head_dim, value_dim, dtype)
        for name, tensor in self.format.allocate(shape, self.device).items():
            setattr(self, name, tensor)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.value_norm = (torch.zeros(shape, dtype=torch.float32, device=self.device)
                           if self.row_policies.uses_value_norm else None)
        self.token_index = torch.full(shape, -1, dtype=torch.long, device=self.device)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=self.device)
        self.evicted = torch.zeros(batch, heads, dtype=torch.long, device=self.device)
        self.evicted_share = torch.zeros(batch, heads, dtype=torch.float32, device=self.device)
        # (sequence, head) coordinates of a per-(sequence, head) slot index, for in-place writes
        self.coordinates = reference.slot_coordinates(batch, heads, self.device)
        self.rows = self.row_policies.parameters(self.layer_idx, batch, self.device)
        self.evictor = self._choose_eviction()
        self.slots_in_use = self.tokens_fed_with_padding = 0
        self.tier.allocate(self, batch, heads, head_dim, value_dim, dtype, self.device)
        self.is_initialized = True

    def share_rows(self, source: "H2OLayer", rows: int) -> None:
        """This layer as rows [0, rows) of ``source`` (``H2OCache.prefix``): its state tensors are
        views of ``source``'s, its kernels and eviction route chosen as ``source``'s were."""
        if source.rows.spare_slots or not isinstance(source.rows.recent, int):
            raise ValueError("a prefix of rows with per-row policies is not supported")
        self.device, self.dtype, self.kernels, self.format = source.device, source.dtype, source.kernels, source.format
        for name in SLOT_TENSORS:
            tensor = getattr(source, name)
            setattr(self, name, tensor[:rows] if tensor is not None else None)
        self.coordinates = reference.slot_coordinates(rows, source.keys.shape[1], self.device)
        self.rows = source.rows
        self.evictor = self._choose_eviction()
        self.set_host_counters(*source.host_counters())
        self.is_initialized = True

    def use_tier(self, tier) -> None:
        """This layer's tier, before its slots are allocated (``H2OCache.use_tier``)."""
        if self.is_initialized:
            raise ValueError("a layer's tier is chosen before its slots are allocated")
        self.tier = tier

    @property
    def columns(self) -> int:
        """Slot columns allocated per (sequence, KV head): the policy's and the tier's."""
        return self.capacity + self.tier.columns

    def _choose_eviction(self):
        """The steady-state eviction for this layer's kernels, policy and tier: a tier that archives
        sees the victim before it is overwritten (``_evict_to_tier``, on every backend); a built-in
        rank goes through ``evict_by_policy`` (one Triton launch on CUDA; on the CPU the reference the
        kernel is tested against: the same rank, priority and write); a rank of its own (random) or
        rows of different budgets through a priority computed here (``_evict_by_priority``)."""
        if self.tier.archives or self.format.quantized:  # (codes and scales: written by _evict_to_tier)
            return self._evict_to_tier
        if self.fused_eviction_parameters is not None and not self.rows.spare_slots:
            return self._evict_fused
        return self._evict_by_priority

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this layer updates in place, by name (first dimension: the batch row). A
        compiled step's CUDA graph reads and writes exactly these; ``H2OCache.export_row`` copies them."""
        if not self.is_initialized:
            return {}
        state = {name: getattr(self, name) for name in SLOT_TENSORS if getattr(self, name) is not None}
        return {**state, **self.tier.state_tensors()}

    def reset_row(self, row: int) -> None:
        """Empty batch row ``row`` (no tokens, scores and counters 0), leaving the other rows alone."""
        for name, tensor in self.state_tensors().items():
            tensor[row] = -1 if name in EMPTY_AS_MINUS_ONE else self.tier.empty_value(name)

    def update(self, key_states, value_states, *args, **_):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending_key, self.pending_value = key_states, value_states
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.tokens_fed_with_padding

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots_in_use + query_length, self.tokens_fed_with_padding - self.slots_in_use

    def compiled_sizes(self, query_length: int) -> tuple[int, int]:
        """``get_mask_sizes`` inside a compiled decode step (``H2OCache.get_mask_sizes`` asks): nothing
        uses the answer (the h2o mask function ignores sizes), and a constant keeps the per-step
        counters out of the graph's guards."""
        return self.capacity + query_length, 0

    def get_max_length(self) -> int:
        return self.kind.max_length(self.capacity)

    def reset(self) -> None:
        """Drop the slots (their memory goes back): the layer allocates again on its next update."""
        self.is_initialized = False
        for name in SLOT_TENSORS:
            setattr(self, name, None)
        self.slots_in_use = self.tokens_fed_with_padding = 0
        self.pending_key = self.pending_value = None
        self.tier.reset()

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

    def attend(self, query, key, value, new_valid, scale, context: StepContext) -> torch.Tensor:
        """Attention for Q new tokens, then scoring and eviction (``H2OCache.attend`` calls it, with
        the step's ``context``). Returns [B, Hkv, G, Q, D]."""
        batch, q_heads, q_len, head_dim = query.shape
        kv_heads = key.shape[1]
        step = context.numbers
        # a row left out of a decode step (``StepNumbers.active``) is a padding token to the attention:
        # it changes no score (no decay either)
        attend_valid = new_valid if step.active is None else step.active.view(batch, 1)
        self.tier.before_attention(self, query, new_valid, context)
        if self.kind.grows:  # the full cache (kv.full) makes room before the step
            columns = self.kind.columns_needed(self.slots_in_use, self.capacity, q_len)
            if columns is not None:
                self._widen(columns)
        grouped = query.view(batch, kv_heads, q_heads // kv_heads, q_len, head_dim)
        if self.format.quantized:
            whole = context.static_shapes or self.slots_in_use >= self.capacity
            width = self.columns if whole else self.slots_in_use
            out, new_scores = self.format.attend(
                self.kernels, grouped, self.slot_view(width), self.token_index[:, :, :width], key, value,
                attend_valid, scale, self.scores[:, :, :width], self.rows.decay)
            self._insert(key, value, new_scores, new_valid, context)
            return out
        slots = (self.keys, self.values, self.token_index, self.scores)
        if not context.static_shapes and self.slots_in_use < self.capacity:
            slots = tuple(tensor[:, :, : self.slots_in_use] for tensor in slots)
        cache_keys, cache_values, token_index, scores = slots
        out, new_scores = self.kernels.attend_with_scores(
            grouped, cache_keys, cache_values, token_index, key, value, attend_valid, scale, scores, self.rows.decay)
        self._insert(key, value, new_scores, new_valid, context)
        return out

    def _insert(self, key, value, new_scores, new_valid, context: StepContext) -> None:
        step = context.numbers
        self.tier.before_insert(self)
        q_len = key.shape[2]
        value_norm = value.float().norm(dim=-1) if self.value_norm is not None else None
        decoding = q_len == 1 and new_valid is None
        # (static_shapes is read first: a compiled step must not read, hence guard on, slots_in_use)
        if decoding and (context.static_shapes or self.slots_in_use == self.capacity or self.rows.spare_slots):
            # steady state: the lowest-priority slot of each (sequence, head) is overwritten in place;
            # an empty slot ranks lowest, so a cache that is not full yet fills its next slot
            # (the mask goes only where there is one: wrappers of evict_one may not take it)
            self.evict_one(key, value, new_scores[:, :, 0], step.token_index[:, 0], step.positions[:, 0],
                           value_norm[:, :, 0] if value_norm is not None else None,
                           **({} if step.active is None else {"active": step.active}))
            if not context.compiled:  # a compiled step leaves them to H2OCache.compiled_decode
                self.count_decoded()
            return
        used, capacity = self.slots_in_use, self.capacity
        if self.rows.spare_slots and not decoding and used + q_len > self.rows.smallest_slots:
            raise ValueError("a multi-token step must fit every row's budget (the opening chunk only)")
        if used + q_len <= capacity:
            end = used + q_len
            stored = self.format.encode(key, value)
            writes = [*((getattr(self, name), new) for name, new in stored.items()), (self.scores, new_scores),
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
            self._select(key, value, new_scores, step.token_index, step.positions, value_norm, context.newest)
        self.tokens_fed_with_padding += q_len

    def count_decoded(self) -> None:
        """The host counters after one decode step (one token per row, evicted in place)."""
        self.slots_in_use = min(self.slots_in_use + 1, self.capacity)
        self.tokens_fed_with_padding += 1

    def host_counters(self) -> tuple[int, int]:
        """(slot columns in use, columns fed with padding): what ``set_host_counters`` puts back."""
        return self.slots_in_use, self.tokens_fed_with_padding

    def set_host_counters(self, slots_in_use: int, tokens_fed_with_padding: int) -> None:
        """The host counters as the cache knows them to be (a restored, imported or synthetic state)."""
        self.slots_in_use, self.tokens_fed_with_padding = slots_in_use, tokens_fed_with_padding

    def priority(self, scores, token_index, newest, value_norm) -> torch.Tensor:
        """Keep priority [B, Hkv, S] of every slot (higher = keep): each row by its policy (a built-in
        rank every row shares straight from the kernels' reference, as the fused eviction computes it)."""
        parameters = self.fused_eviction_parameters
        if parameters is not None:
            rank = reference.slot_rank(scores, token_index, newest, value_norm, **parameters)
        else:
            rank = self.row_policies.rank(scores, token_index, newest, value_norm, self.rows)
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

    def _evict_by_priority(self, key, value, new_score, token_index, position, value_norm, active=None) -> None:
        """The policy's priority computed in torch (the kernels' rules), then the backend's
        ``evict_and_insert``: the reference on the CPU, the kernel on Triton."""
        mass = self.scores.sum(dim=-1)  # before the overwrite (see _count_one_eviction)
        priority = self.priority(self.scores, self.token_index, token_index, self.value_norm)
        dropped, dropped_score = self.kernels.evict_and_insert(
            priority, self.keys, self.values, self.scores, self.token_index, self.positions, key, value, new_score,
            token_index, position, self.value_norm, value_norm, active, coordinates=self.coordinates)
        self._count_one_eviction(dropped, dropped_score, mass)

    def _evict_fused(self, key, value, new_score, token_index, position, value_norm, active=None) -> None:
        """The policy's rank, the priority, argmin and the overwrite from the policy's parameters: one
        launch on Triton, ``reference.evict_by_policy`` on the CPU."""
        mass = self.scores.sum(dim=-1)
        dropped, dropped_score = self.kernels.evict_by_policy(
            self.keys, self.values, self.scores, self.token_index, self.positions, key, value, new_score, token_index,
            position, self.value_norm, value_norm, active, recent=self.rows.recent, sinks=self.rows.sinks,
            coordinates=self.coordinates, **self.fused_eviction_parameters)
        self._count_one_eviction(dropped, dropped_score, mass)

    def _evict_to_tier(self, key, value, new_score, token_index, position, value_norm, active=None) -> None:
        """The victim chosen once (``reference.lowest_slots``: the tier's columns never go), handed to
        the tier, then overwritten (``reference.write_slots``): the tier archives exactly the token
        the slot held. The tier's layers take every row every step (``masks_inactive_rows``)."""
        mass = self.scores.sum(dim=-1)
        priority = self.priority(self.scores, self.token_index, token_index, self.value_norm)
        slot = reference.lowest_slots(priority[:, :, : self.capacity])
        self.tier.archive(self, slot)
        if self.format.quantized:  # the codes go where the token would; its scales and offsets beside them
            stored = self.format.encode(key, value)
            key, value = stored["keys"], stored["values"]
            self.format.write_scales(slot, {name: getattr(self, name) for name in SCALE_TENSORS}, stored, active,
                                     self.coordinates)
        dropped, dropped_score = reference.write_slots(
            slot, self.keys, self.values, self.scores, self.token_index, self.positions, key, value, new_score,
            token_index, position, self.value_norm, value_norm, active, coordinates=self.coordinates)
        self._count_one_eviction(dropped, dropped_score, mass)

    def _count_one_eviction(self, dropped, dropped_score, mass) -> None:
        """``_count_evictions`` for one slot in fewer ops: scores are >= 0 and empty and padding slots
        hold score 0 (no attention reaches them), so an empty slot dropped held 0 and a (sequence,
        head) of mass 0 dropped 0: neither needs a mask or a branch. A row an active mask left out
        reports dropped -1 and score 0: its counters add 0."""
        self.evicted += dropped >= 0
        self.evicted_share += dropped_score / mass.clamp_min(1e-30)

    def _count_evictions(self, evicted: torch.Tensor, dropped_score: torch.Tensor, mass: torch.Tensor) -> None:
        """``evicted`` [B, Hkv] (bool, or a count), ``dropped_score`` their summed score, ``mass`` the
        score mass of the (sequence, head) at that moment."""
        self.evicted += evicted
        self.evicted_share += torch.where(mass > 0, dropped_score / mass.clamp_min(1e-30), 0.0) * (evicted > 0)

    def _select(self, key, value, new_scores, token_index, positions, value_norm, newest) -> None:
        """Several new tokens (a prefill chunk, or padding): keep the best C of slots + new
        (``newest`` [B]: each row's newest token index, this step's counted)."""
        batch, heads, q_len, head_dim = key.shape
        used, capacity = self.slots_in_use, self.capacity
        expand = (batch, heads, q_len)
        stored = self.format.encode(key, value)
        candidates = {
            **{name: torch.cat([getattr(self, name)[:, :, :used], new], dim=2) for name, new in stored.items()},
            "scores": torch.cat([self.scores[:, :, :used], new_scores], dim=2),
            "token_index": torch.cat([self.token_index[:, :, :used], token_index.unsqueeze(1).expand(expand)], dim=2),
            "positions": torch.cat([self.positions[:, :, :used], positions.unsqueeze(1).expand(expand)], dim=2),
        }
        if value_norm is not None:
            candidates["value_norm"] = torch.cat([self.value_norm[:, :, :used], value_norm], dim=2)
        priority = self.priority(candidates["scores"], candidates["token_index"], newest, candidates.get("value_norm"))
        keep = priority.topk(capacity, dim=-1).indices.sort(dim=-1).values
        valid = candidates["token_index"] >= 0
        mass = candidates["scores"].masked_fill(~valid, 0).sum(dim=-1)
        kept_valid = valid.gather(2, keep)
        dropped_score = mass - candidates["scores"].gather(2, keep).masked_fill(~kept_valid, 0).sum(dim=-1)
        if self.tier.archives:  # the candidates that are not kept, for the tier to take
            dropped = valid & ~torch.zeros_like(valid).scatter_(2, keep, True)
            self.tier.archive_dropped(self, candidates, dropped)
        for name, candidate in candidates.items():
            index = keep if candidate.dim() == 3 else keep.unsqueeze(-1).expand(-1, -1, -1, candidate.shape[-1])
            getattr(self, name)[:, :, :capacity] = reference.gather_slots(candidate, index)
        self._count_evictions(valid.sum(-1) - kept_valid.sum(-1), dropped_score, mass)
        self.slots_in_use = capacity

    def _widen(self, capacity: int) -> None:
        """The full cache's growth (``kv.full``): every slot tensor reallocated to ``capacity`` columns."""
        for name in SLOT_TENSORS:
            tensor = getattr(self, name)
            if tensor is not None and tensor.dim() > 2:  # per slot (the eviction counters are per (row, head))
                setattr(self, name, widened(tensor, capacity, -1 if name in EMPTY_AS_MINUS_ONE else 0))
        self.capacity = capacity

    # -- the slots' keys and values, whatever their format -----------------------------------------
    def slot_view(self, width: int | None = None) -> dict[str, torch.Tensor]:
        """The keys and values (and scales and offsets, when quantized) of the first ``width`` slot
        columns (None: all), as views: what ``kv.slot_format`` reads and writes."""
        return {name: getattr(self, name)[:, :, :width] for name in ("keys", "values", *SCALE_TENSORS)
                if getattr(self, name) is not None}

    def move_keys(self, delta: torch.Tensor, rotary) -> None:
        """RoPE keys turned by ``delta`` [B, Hkv, S] positions (a re-numbering), in place."""
        self.format.move_keys(self.slot_view(), delta, rotary)

    def slot_bytes(self) -> int:
        """Device bytes of one slot column of one row, every KV head: keys, values, scales, offsets."""
        return self.keys.shape[1] * self.format.slot_bytes

    # -- statistics -------------------------------------------------------------------------------
    def stats(self, tokens_fed: torch.Tensor):
        """This layer's figures (``kv.accounting.layer_stats``) when each row has been fed ``tokens_fed`` [B]."""
        return layer_stats(self, tokens_fed)

    def protected(self, newest: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, C] bool: the slots the policy never evicts (recent window and sinks) when each
        row's newest token index is ``newest`` [B]."""
        return kernels.protected_slots(self.token_index, newest, self.rows.recent, self.rows.sinks)
