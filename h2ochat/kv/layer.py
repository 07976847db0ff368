"""One layer of the H2O cache: transformers' ``CacheLayerMixin`` over a fixed number of slot columns,
composed of the slots (keys, values and, per slot, the fp32 score, the token's index in the text
(-1: empty or padding), the position it was encoded at and, for policies that rank by it, its
value norm), the policy's per-row parameters (``kv.rows.RowParameters``), a kernel backend chosen
once at allocation (``h2ochat_kernels.Backend``: attention, evictions, page scores), the slot format
(``kv.slot_format``: it owns the keys and values tensors) and a tier (``kv.tier``: none, or recall),
which the layer reaches through its port (``kv.tier_port.TierPort``) and never imports.

A step with Q new tokens: the tier runs first (``before_attention``), the attention runs over the
occupied slots plus the new tokens (``Backend.attend_with_scores``) and updates the scores as the
policy says (S <- decay * S + attention), then the layer keeps C = ``capacity`` of the candidates: the
protected ones (recent window, sinks) and the policy's best among the rest. A decode step overwrites
each (sequence, head)'s lowest-priority slot in place; a tier that archives sees that victim first
(the eviction routes: ``kv.eviction``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

import h2ochat_kernels as kernels
from h2ochat_kernels import reference

from ..host_buffers import fill_empty
from ..policies import SlotBudget
from .accounting import layer_stats
from .eviction import LayerEviction
from .full import widened
from .host_counters import LayerCounters
from .numbering import StepContext
from .slot_format import slot_format
from .tier_port import TierPort


# every per-row tensor a layer keeps beside its slot format's (value_norm: None unless the policy ranks by it)
BOOKKEEPING_TENSORS = ("scores", "token_index", "positions", "value_norm", "evicted", "evicted_share")
EMPTY_AS_MINUS_ONE = ("token_index", "positions")  # an empty slot's token index and position; the rest start at 0


class AttentionMismatchError(RuntimeError):
    """The H2OCache was driven by something other than the ``h2o`` attention function."""


@dataclass(frozen=True)
class LayerSetup:
    """What a cache tells each of its layers once, at construction: the rows' policies and budgets
    (``kv.rows.RowPolicies``) and ``--kv-dtype``. Per-step facts, the cache's kind (bounded, or
    growing: ``kv.full``) among them, come with each step instead (``StepContext``)."""

    row_policies: object  # kv.rows.RowPolicies
    kv_dtype: str


class H2OLayer(LayerEviction, CacheLayerMixin):
    """One layer: its slots, its policy's parameters (``rows``), its kernels (``kernels``, a
    ``Backend`` chosen once at allocation), its slot format (``format``, whose tensors are
    ``stored``) and its tier (``tier``, see ``kv.tier``, reached through ``port``). The policy works
    on the first ``capacity`` slot columns; the tier owns ``tier.columns`` more after them (where:
    the port says), which the policy never ranks. Host counters (``counters``, this layer's part of
    the cache's ``kv.host_counters.HostCounters``, held by reference): ``slots_in_use`` (slot columns
    holding a token or padding, the same for every row and head) and ``tokens_fed_with_padding``
    (columns fed, padding included); the per-row counts of real tokens and positions live in the
    cache (``H2OCache.tokens_fed``, ``H2OCache.next_position``), one source for every layer. The
    layer holds no reference to its cache: it is told its setup once (``LayerSetup``) and each
    step's facts with the step (``StepContext``, ``attend``)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, layer_idx: int, setup: LayerSetup, tier):
        # (not CacheLayerMixin.__init__: its ``keys``/``values`` fields are the slot format's here)
        self.is_initialized = False
        self.layer_idx, self.setup = layer_idx, setup
        self.row_policies = setup.row_policies
        self.fused_eviction_parameters = setup.row_policies.fused_eviction_parameters
        self.budgets = setup.row_policies.budgets(layer_idx)  # one per row group
        self.capacity = max(budget.slots for budget in self.budgets)  # the policy's columns
        self.tier = tier
        self.tier_shared = False  # a prefix's layer steps its source's tier (``share_rows``): not its to reset
        self.counters = LayerCounters()
        self.stored: dict[str, torch.Tensor] = {}  # the slot format's tensors, by its names
        self.port: TierPort | None = None
        self.pending_key = self.pending_value = None

    # -- the host counters (``counters``: shared with the cache's prefix views) ----------------------
    @property
    def slots_in_use(self) -> int:
        return self.counters.slots_in_use

    @slots_in_use.setter
    def slots_in_use(self, value: int) -> None:
        self.counters.slots_in_use = value

    @property
    def tokens_fed_with_padding(self) -> int:
        return self.counters.tokens_fed_with_padding

    @tokens_fed_with_padding.setter
    def tokens_fed_with_padding(self, value: int) -> None:
        self.counters.tokens_fed_with_padding = value

    @property
    def keys(self) -> torch.Tensor | None:
        return self.stored.get("keys")

    @property
    def values(self) -> torch.Tensor | None:
        return self.stored.get("values")

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
        self.stored = self.format.allocate(shape, self.device)
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
        self.port = self._make_port()
        self.evictor = self.choose_eviction()
        self.counters.set(0, 0)
        self.tier.allocate(self.port, batch, heads, head_dim, value_dim, dtype, self.device)
        self.is_initialized = True

    def _make_port(self) -> TierPort:
        return TierPort(self.capacity, self.tier.columns, self.per_slot_tensors(), self.counters,
                        coordinates=self.coordinates, slot_format=self.format, kernels=self.kernels, rows=self.rows,
                        layer=self.layer_idx)

    def share_rows(self, source: "H2OLayer", rows: int) -> None:
        """This layer as rows [0, rows) of ``source`` (``H2OCache.prefix``): its state tensors are
        views of ``source``'s, its kernels and eviction route chosen as ``source``'s were, its tier
        ``source``'s."""
        if source.rows.spare_slots or not isinstance(source.rows.recent, int):
            raise ValueError("a prefix of rows with per-row policies is not supported")
        self.device, self.dtype, self.kernels, self.format = source.device, source.dtype, source.kernels, source.format
        self.stored = {name: tensor[:rows] for name, tensor in source.stored.items()}
        for name in BOOKKEEPING_TENSORS:
            tensor = getattr(source, name)
            setattr(self, name, tensor[:rows] if tensor is not None else None)
        self.coordinates = reference.slot_coordinates(rows, source.keys.shape[1], self.device)
        self.rows = source.rows
        self.counters = source.counters  # one set of host counters for the rows both hold
        # the source's tier itself, where it takes a step of the first rows (``TierSpec.row_prefixes``):
        # a tier's state (a cold store that grows) is not views of its first rows
        self.tier, self.tier_shared = source.tier, True
        self.port = self._make_port()
        self.evictor = self.choose_eviction()
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

    def per_slot_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor with a slot column dimension (2), by name: the format's, then the bookkeeping."""
        named = {**self.stored, "scores": self.scores, "token_index": self.token_index, "positions": self.positions}
        if self.value_norm is not None:
            named["value_norm"] = self.value_norm
        return named

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this layer updates in place, by name (first dimension: the batch row). A
        compiled step's CUDA graph reads and writes exactly these; ``H2OCache.export_row`` copies them."""
        return {**self.own_state_tensors(), **self.tier.state_tensors()} if self.is_initialized else {}

    def own_state_tensors(self) -> dict[str, torch.Tensor]:
        """Those of ``state_tensors`` that are the layer's own, its slots and their bookkeeping (a row move
        hands the tier's to the tier: ``Tier.export_row``/``import_row``)."""
        if not self.is_initialized:
            return {}
        bookkeeping = {name: getattr(self, name) for name in BOOKKEEPING_TENSORS if getattr(self, name) is not None}
        return {**self.stored, **bookkeeping}

    def reset_row(self, row: int) -> None:
        """Empty batch row ``row`` (no tokens, scores and counters 0), leaving the other rows alone."""
        for name, tensor in self.state_tensors().items():
            fill_empty(tensor[row], -1 if name in EMPTY_AS_MINUS_ONE else self.tier.empty_value(name))
        forget = getattr(self.tier, "reset_row", None)  # (a tier with host counters per row starts them again)
        if forget is not None:
            forget(row)

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
        """A bounded layer's (``H2OCache.get_max_length`` answers for the cache's kind)."""
        return self.capacity

    def reset(self) -> None:
        """Drop the slots (their memory goes back): the layer allocates again on its next update."""
        self.is_initialized = False
        self.stored, self.port = {}, None
        for name in BOOKKEEPING_TENSORS:
            setattr(self, name, None)
        self.counters.set(0, 0)
        self.pending_key = self.pending_value = None
        if not self.tier_shared:
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
        rest = self.tier.before_attention(self.port, query, new_valid, scale, context)  # (what the slots do not hold)
        if context.kind.grows:  # the full cache (kv.full) makes room before the step
            columns = context.kind.columns_needed(self.slots_in_use, self.capacity, q_len)
            if columns is not None:
                self._widen(columns)
        grouped = query.view(batch, kv_heads, q_heads // kv_heads, q_len, head_dim)
        # (static_shapes is read first: a compiled step must not read, hence guard on, slots_in_use)
        if (context.static_shapes or self.slots_in_use >= self.capacity
                or self.kernels.attends_every_column(q_len, self.slots_in_use, self.capacity, self.keys)):
            # every column (no views to make; the empty ones are masked by their token index)
            slots, token_index, scores = self.stored, self.token_index, self.scores
        else:
            width = self.slots_in_use
            slots, token_index, scores = self.slot_view(width), self.token_index[:, :, :width], self.scores[:, :, :width]
        out, new_scores = self.format.attend(self.kernels, grouped, slots, token_index, key, value, attend_valid,
                                             scale, scores, self.rows.decay, rest)
        self._insert(key, value, new_scores, new_valid, context)
        return out

    def _insert(self, key, value, new_scores, new_valid, context: StepContext) -> None:
        step = context.numbers
        self.tier.before_insert(self.port)
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
            writes = [*((self.stored[name], new) for name, new in stored.items()), (self.scores, new_scores),
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
        return self.counters.values()

    def set_host_counters(self, slots_in_use: int, tokens_fed_with_padding: int) -> None:
        """The host counters as the cache knows them to be (a restored, imported or synthetic state)."""
        self.counters.set(slots_in_use, tokens_fed_with_padding)

    def _widen(self, capacity: int) -> None:
        """The full cache's growth (``kv.full``): every slot tensor reallocated to ``capacity`` columns
        (a growing cache has no tier: nothing holds views of the old ones)."""
        self.stored = {name: widened(tensor, capacity, 0) for name, tensor in self.stored.items()}
        for name in ("scores", "token_index", "positions", "value_norm"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, widened(tensor, capacity, -1 if name in EMPTY_AS_MINUS_ONE else 0))
        self.capacity = capacity
        self.port = self._make_port()

    # -- the slots' keys and values, whatever their format -----------------------------------------
    def slot_view(self, width: int | None = None) -> dict[str, torch.Tensor]:
        """The slot format's tensors (keys and values, and their scales and offsets when quantized)
        of the first ``width`` slot columns (None: all), as views: what ``kv.slot_format`` reads and writes."""
        return {name: tensor[:, :, :width] for name, tensor in self.stored.items()}

    def move_keys(self, delta: torch.Tensor, rotary) -> None:
        """RoPE keys turned by ``delta`` [B, Hkv, S] positions (a re-numbering), in place."""
        self.format.move_keys(self.slot_view(), delta, rotary)

    def renumber(self, renumbering, rotary) -> None:
        """Every held token (every slot column, the tier's included) to its new position
        (``kv.numbering.Renumbering``), RoPE keys turned to match, in place; then the tier moves what
        it holds elsewhere (a cold store) with the same function."""
        valid = self.token_index >= 0
        new_positions = renumbering.apply(self.positions, valid)
        if rotary is not None:
            self.move_keys((new_positions - self.positions).masked_fill(~valid, 0), rotary)
        self.positions.copy_(new_positions)
        self.tier.renumber(self.port, renumbering, rotary)

    def write_columns(self, stop: int, named: dict[str, torch.Tensor]) -> None:
        """Columns [0, stop) of the per-slot tensors ``named`` (``per_slot_tensors`` names; the
        format's in its encoding) overwritten, for every row (a synthetic context: ``kv.synthetic``)."""
        targets = self.per_slot_tensors()
        for name, new in named.items():
            targets[name][:, :, :stop] = new

    def slot_bytes(self) -> int:
        """Device bytes of one slot column of one row, every KV head: keys, values, scales, offsets."""
        return self.keys.shape[1] * self.format.slot_bytes

    # -- statistics -------------------------------------------------------------------------------
    def stats(self, tokens_fed: torch.Tensor, grows: bool = False):
        """This layer's figures (``kv.accounting.layer_stats``) when each row has been fed ``tokens_fed``
        [B] (``grows``: of a full cache, which keeps nothing on merit)."""
        return layer_stats(self, tokens_fed, grows)

    def protected(self, newest: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, C] bool: the slots the policy never evicts (recent window and sinks) when each
        row's newest token index is ``newest`` [B]."""
        return kernels.protected_slots(self.token_index, newest, self.rows.recent, self.rows.sinks)
