"""The transformers ``Cache`` of h2ochat: a fixed number of preallocated KV slots per layer, evicting
by policy (``kv.layer.H2OLayer`` does the work of a step), and the one owner of the per-row counters.

How the model reaches a layer: every attention module calls ``cache.update(k, v, layer_idx)`` just
before its attention function. ``update`` records the new keys as pending and the registered
``h2o`` attention function (attention.py) attends them through ``H2OLayer.attend``. A pending step
nobody attended (the model runs another attention implementation) raises at the next ``update``.

Positions and token indices have one source: the cache numbers each step's new tokens once
(``H2OCache.position_ids``, ``kv.stepping``) and hands every layer the same ``StepContext``; a
re-numbering maps each row's held tokens to new positions as a function of their old ones, so every
layer and head agrees. The host counters are one object (``kv.host_counters``) the cache shares with
its prefix views.

One cache can serve a batch whose rows follow different policies and budgets (``kv.make_mixed_cache``,
used by ``h2ochat eval``): each layer then allocates the largest row's slots, and a row with fewer
slots leaves its spare ones unused once it holds its own number of tokens, so it evicts exactly as
a cache of its own size would.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Sequence

import torch
from transformers.cache_utils import Cache

from ..policies import Policy, SlotBudget, get_policy
from ..rotary import Rotary
from .accounting import CacheAccounting
from .full import BOUNDED, cache_kind
from .last_update import last_update
from .layer import AttentionMismatchError, H2OLayer, LayerSetup
from .host_counters import HostCounters, SavedHostCounters
from .numbering import StepContext, StepNumbers
from .row_moves import RowMoves
from .stepping import CacheStepping
from .rows import CacheShapeError, RowPolicies, RowSpec
from .slot_format import check_kv_dtype
from .tier import NO_TIER, TierSpec


class H2OCache(CacheStepping, CacheAccounting, RowMoves, Cache):
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

    ``tier``: a second home for evicted tokens (``kv.tier``; ``recall.spec.RecallSpec`` keeps them in
    a cold store and recalls pages of them into ``tier.columns`` extra slots per layer). ``slots``
    are the policy's, the tier's columns come on top.
    ``kv_dtype``: how the slots hold keys and values (``kv.slot_format``: auto, a float type, int8, int4).
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
        tier: TierSpec = NO_TIER,
        kv_dtype: str = "auto",
    ):
        if positions not in ("compact", "absolute"):
            raise ValueError(f"positions must be 'compact' or 'absolute', got {positions!r}")
        self.slots = slots
        self.row_policies = RowPolicies(list(rows) if rows else [RowSpec(get_policy(policy), slots, seed)], num_layers)
        self.policy = self.row_policies.policy
        self.kind = cache_kind(spec.policy for spec in self.row_policies.specs)  # bounded, or full (kv.full)
        self.max_positions, self.position_mode, self.rotary = max_positions, positions, rotary
        self.static_shapes = static_shapes
        self.kv_dtype = check_kv_dtype(kv_dtype)  # how the slots hold keys and values (kv.slot_format)
        self.tier = tier
        tier.check(self)
        # what ``prefix`` makes another cache of the same kind from
        self.construction = dict(num_layers=num_layers, policy=policy, slots=slots, max_positions=max_positions,
                                 positions=positions, rotary=rotary, seed=seed, static_shapes=static_shapes,
                                 rows=rows, tier=tier, kv_dtype=kv_dtype)
        setup = LayerSetup(self.row_policies, self.kv_dtype)
        super().__init__(layers=[self.layer_type(index, setup, tier.make()) for index in range(num_layers)])
        # the host counters, one object shared with the prefix views (``kv.host_counters``)
        self.host = HostCounters([layer.counters for layer in self.layers])
        self._clear_counters()

    # -- the rows' policies (``RowPolicies``), as the layers and the views read them ----------------
    @property
    def row_specs(self) -> list[RowSpec]:
        return self.row_policies.specs

    @property
    def generator(self) -> torch.Generator | None:
        """The first row's generator (a policy with its own draws: random)."""
        return self.row_policies.generators[0]

    @property
    def uses_value_norm(self) -> bool:
        return self.row_policies.uses_value_norm

    @property
    def grows(self) -> bool:
        """The full cache (``kv.full``): nothing is evicted, the slots grow with the text."""
        return self.kind.grows

    @property
    def fused_eviction_parameters(self) -> dict | None:
        return self.row_policies.fused_eviction_parameters

    def _clear_counters(self) -> None:
        """The cache-level state an empty cache starts from (``__init__`` and ``reset``)."""
        self.tokens_fed: torch.Tensor | None = None  # [B] real tokens fed per row
        self.next_position: torch.Tensor | None = None  # [B] the next real token's position per row
        self.host.clear()  # the bound on positions, the re-numberings, the layers' columns (in place)
        self.pending: H2OLayer | None = None  # the layer whose new keys wait for the attention
        self.step: StepNumbers | None = None  # the current step's token indices and positions
        self.context: StepContext | None = None  # what the layers are handed with the current step
        self.step_layer = -1  # the deepest layer that has taken the current step's numbers
        # True inside ``compiled_decode()``: see there which fields it leaves stale
        self.compiled_step = False
        # the slots are marked as fixed addresses for CUDA graphs (h2ochat.compiled); new slots are not
        self.static_addresses_marked = False

    def compile_blocker(self) -> str | None:
        """Why the compiled decode step (``h2ochat.compiled``) cannot take this cache, or None."""
        if self.kind.compile_blocker:
            return self.kind.compile_blocker
        if self.mixed:
            return "rows with different policies (eval) rank row by row"
        if self.fused_eviction_parameters is None:
            return f"the {self.policy.name} policy ranks with its own code (e.g. a seeded random draw on the host)"
        return self.tier.compile_blocker(self)

    # -- the host counters (``host``: one object, shared with the prefix views) ----------------------
    @property
    def largest_next_position(self) -> int:
        return self.host.largest_next_position

    @largest_next_position.setter
    def largest_next_position(self, value: int) -> None:
        self.host.bound_positions(value)

    @property
    def compactions(self) -> int:
        """Re-numberings so far."""
        return self.host.compactions

    @compactions.setter
    def compactions(self, value: int) -> None:
        self.host.count_compactions(value)

    # -- the policy, per row ---------------------------------------------------------------------
    @property
    def mixed(self) -> bool:
        return self.row_policies.mixed

    @property
    def evicts(self) -> bool:
        return not self.grows

    @property
    def budget(self) -> SlotBudget:
        """The first layer's share-out of the first row (what the UI shows)."""
        return self.row_policies.layer_budgets[0][0]

    # -- transformers' interface ------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.pending is not None:
            raise AttentionMismatchError(
                f"layer {self.pending.layer_idx}'s new keys never reached the h2o attention: an H2OCache needs the "
                "model loaded with attn_implementation='h2o' (h2ochat.attention.use_h2o_attention(model))"
            )
        self.pending = self.layers[layer_idx]
        last_update.record(self, self.pending)  # how the attention finds this cache under transformers' generate()
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def attend(self, layer_idx: int, query, key, value, new_valid, scale) -> torch.Tensor:
        """The h2o attention of layer ``layer_idx`` over its slots and the keys ``update`` parked
        (``H2OLayer.attend``, handed this step's ``StepContext``). Returns [B, Hkv, G, Q, D]."""
        layer = self.layers[layer_idx]
        layer.take_pending(key)
        self.pending = None  # the next ``update`` may park more
        last_update.release(self)
        batch, _, q_len, _ = query.shape
        return layer.attend(query, key, value, new_valid, scale,
                            self.step_context(layer_idx, batch, q_len, new_valid, query.device))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # inside a compiled decode step nothing uses the answer (positions come from the cache, the
        # h2o mask function ignores sizes): a constant keeps the per-step counter out of the graph's guards
        if self.compiled_step and layer_idx < len(self.layers):
            return self.layers[layer_idx].capacity
        return super().get_seq_length(layer_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """The length a layer holds at most: its capacity, or -1 (no limit) for a cache that grows."""
        layers = self.layers if layer_idx is None else [self.layers[layer_idx]]
        return max(self.kind.max_length(layer.capacity) for layer in layers)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if self.compiled_step and layer_idx < len(self.layers):
            return self.layers[layer_idx].compiled_sizes(query_length)
        return super().get_mask_sizes(query_length, layer_idx)

    def use_tier(self, tier: TierSpec) -> None:
        """Give an empty cache another tier (one that measures more, say), before anything is fed."""
        if self.initialized:
            raise ValueError("a cache's tier is chosen before anything is fed")
        tier.check(self)
        self.tier = tier
        for layer in self.layers:
            layer.use_tier(tier.make())

    def use_static_shapes(self) -> None:
        """Decode steps from now on attend over all C slots and evict in place (the compiled step's shapes)."""
        self.static_shapes = True
        self._refresh_context()

    def _refresh_context(self) -> None:
        """The current step's context again, after its mode changed (static shapes, the compiled step)."""
        if self.context is not None:
            self.context = replace(self.context, compiled=self.compiled_step, static_shapes=self.static_shapes,
                                   kind=self.kind)

    def mark_static_addresses(self) -> None:
        """Mark every tensor a step writes as a fixed address for CUDA graphs (once; the slots are
        updated in place, never replaced: tests/test_kernel_ops.py checks the graph)."""
        if self.static_addresses_marked or not self.initialized:
            return
        for layer in self.layers:
            for tensor in layer.state_tensors().values():
                torch._dynamo.mark_static_address(tensor)
        self.static_addresses_marked = True

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
        self._refresh_context()
        try:
            yield
        finally:
            self.compiled_step = False
            self._refresh_context()
        for layer in self.layers:
            layer.count_decoded()

    # -- one batch row at a time ---------------------------------------------------------------------
    def allocate(self, batch: int, kv_heads: int, head_dim: int, *, dtype, device, value_dim: int | None = None) -> None:
        """Initialise every layer with empty slots for ``batch`` rows, without a forward."""
        self._clear_counters()
        for layer in self.layers:
            layer.allocate(batch, kv_heads, head_dim, value_dim or head_dim, dtype, device)
        self.counters_for(batch, torch.device(device))

    def keep_columns(self) -> None:
        """A full cache whose owner keeps every row's text within its slots (a server refuses a longer
        conversation) never grows: its columns and shapes stay as allocated, and its rows can be views
        (``prefix``). Nothing else changes: a row fills its empty slots and evicts nothing."""
        if self.grows:
            self.take_kind(BOUNDED)

    def take_kind(self, kind) -> None:
        """Step as a ``kind`` cache (``kv.full``) from now on (the layers are handed it with each step)."""
        self.kind = kind
        self._refresh_context()

    # -- what the generation loop asks -----------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return bool(self.layers) and self.layers[0].is_initialized

    @property
    def masks_inactive_rows(self) -> bool:
        """Whether a decode step can leave rows out (``position_ids(active=...)``): the tier says (a
        cold tier taking evicted tokens does not); a subclass whose layers do more than write their
        slots does not either."""
        return self.tier.masks_inactive_rows and type(self).layer_type is H2OLayer

    @property
    def row_prefixes(self) -> bool:
        """Whether ``prefix`` can make caches over the first rows (their layers share the tiers where the
        tier takes steps of the first rows: ``TierSpec.row_prefixes``)."""
        return self.masks_inactive_rows and self.tier.row_prefixes

    def host_counters(self) -> SavedHostCounters:
        """The host-side counters now, frozen, to put back with ``restore_host_counters``."""
        return self.host.saved()

    def prefix(self, rows: int) -> "H2OCache":
        """A cache over rows [0, rows) of this allocated one, sharing its storage: every layer's slots
        and per-row counters are views of this cache's first rows (nothing is copied, and a step of
        the prefix writes this cache's rows), with a step state of its own. A server runs a decode
        step on the smallest prefix that holds the rows in use. The host counters are one object
        shared by reference (``kv.host_counters``): a step of either advances both. The layers' tiers
        are shared too, where they take a step of the first rows (``TierSpec.row_prefixes``)."""
        if not self.initialized:
            raise CacheShapeError("allocate the cache before taking a prefix of its rows")
        if not self.row_prefixes:
            raise CacheShapeError("this cache's tier has no prefix caches (it steps every row)")
        if not 0 < rows <= self.tokens_fed.shape[0]:
            raise CacheShapeError(f"a prefix of {rows} rows of a {self.tokens_fed.shape[0]}-row cache")
        view = type(self)(**self.construction)
        view.take_kind(self.kind)  # (the view steps as this cache does)
        view.static_shapes = self.static_shapes
        for mine, theirs in zip(view.layers, self.layers):
            mine.share_rows(theirs, rows)
        view.share_counters(self, rows)
        return view

    def share_counters(self, source: "H2OCache", rows: int) -> None:
        """The per-row counters as views of ``source``'s first ``rows`` and its host counters, the same
        object (``prefix``: its layers already hold ``source``'s layers' counters)."""
        self.tokens_fed, self.next_position = source.tokens_fed[:rows], source.next_position[:rows]
        self.host = source.host

    def restore_host_counters(self, saved: SavedHostCounters) -> None:
        """Put back the host counters ``saved`` before decode steps that fed no row at all (every row
        was left out: a burst's steps after its last row finished): those steps changed nothing on
        the device, so the counters are exact again. A re-numbering since then keeps its own
        (exact) ``largest_next_position``."""
        self.host.restore(saved)
