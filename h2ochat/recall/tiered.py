"""The two-tier cache: ``H2OCache`` whose layers keep R extra device slots for recalled tokens.

``RecallCache(num_layers, policy, hot_slots, recall=RecallConfig(R, ...))``: every layer allocates
hot_slots + R slot columns; the policy lives in the first hot_slots (its budget split, its evictions:
the priority of a recall column is +inf, so no eviction ever picks one), the last R hold recalled
pages. A token the policy evicts goes to the layer's cold store and its device digest (captured
before its slot is overwritten; a chunk's evictions in token order). Before each attention (every
prefill chunk, and every ``every``-th decode step) each (sequence, KV head) scores its pages with the
step's queries (the group's query heads times the step's tokens) and the top R / P pages are brought
into the recall columns (``RecallFrames``: pages already there are not copied again). The attention
already attends every slot whose token index is >= 0, so hot and recalled tokens share one softmax;
the recall columns' scores are cleared before each eviction (they rank nothing).

Compact positions: a re-numbering (``H2OCache._renumber``) counts the recall columns among the held
tokens and moves them with the hot ones; the cold stores' positions follow with the same function (a
cold token takes the number of the first held position after it) and the digests are re-encoded
from the cold keys at their new positions (RoPE), so pages are scored as they will be attended.
(Letting cold positions join the distinct set instead, for exact distances between cold tokens,
changed SmolLM2's perplexity past a 256-position limit by 0.1%: 41.42 against 41.47, 40.74 with no
re-numbering at all; not worth the extra compaction.)

No host read in the decode step where the cold store shares the model's device (the CPU): no branch
on its contents, fixed-shape appends (``layout.Writes``), room reserved before the step from host
counters (``RecallLayer.reserve``, called by ``position_ids``); so the compiled decode step takes it
(``compile_blocker``; the stores' slot dimension is traced as a size, ``layout.growable``, so their
growth compiles nothing again; --recall-every above 1 stays eager). Statistics: ``recalled_mass``
and ``attended_mass`` per layer, ``RecallCache.tier_stats``. On a GPU the
cold store is pinned host memory: appends and page copies go through the host, eagerly (the plan for
an asynchronous copy is in ``step``'s docstring). On Triton the eviction is the kernel's, of a
priority computed in torch with +inf on the recall columns (``_lowest_goes_cold``); the attention
kernels attend every column, and the page scores have their own kernel (``selectors``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import h2ochat_kernels as kernels
import torch
from h2ochat_kernels.reference import row_weights

from ..cache import H2OCache, H2OLayer
from ..sizes import parse_share_or_count
from . import selector_names
from .cold_store import COLD_DTYPES, ColdStore
from .bounds import PageBounds
from .digests import KeyCodes
from .step import RecallFrames, RecallSlots, fill_recall_slots


@dataclass(frozen=True)
class RecallConfig:
    slots: int  # R device slots per (layer, sequence, KV head) for recalled tokens
    page: int = 16
    selector: str = "rot4"  # see SELECTOR_HELP
    cold_dtype: str = "same"
    cold_limit: int | None = None  # tokens per (layer, sequence, KV head) kept in the cold store
    every: int = 1  # decode steps between recalls (prefill chunks always recall)

    def __post_init__(self):
        self.check_options(self.page, self.selector, self.cold_dtype, self.cold_limit, self.every)
        if self.slots < self.page or self.slots % self.page:
            raise ValueError(f"--recall {self.slots} must be a whole number (>= 1) of --page {self.page} pages")
        if self.cold_limit is not None and self.cold_limit < self.slots:
            raise ValueError(f"--cold-limit {self.cold_limit} must hold at least the {self.slots} recall slots")

    @staticmethod
    def check_options(page: int, selector: str, cold_dtype: str, cold_limit: int | None, every: int) -> None:
        """The options that do not depend on the slot count, so they can be refused while recall is off
        too (a later --recall would fail on them)."""
        if isinstance(page, bool) or not isinstance(page, int) or page < 1:  # before any `% page`
            raise ValueError(f"--page must be a whole number of tokens >= 1, got {page!r}")
        if cold_limit is not None and cold_limit < 1:
            raise ValueError(f"--cold-limit must be >= 1 token, got {cold_limit}")
        if every < 1:
            raise ValueError(f"--recall-every must be >= 1, got {every}")
        if cold_dtype not in COLD_DTYPES:  # here, not when the first layer allocates mid-run
            raise ValueError(f"--cold-dtype must be one of {', '.join(COLD_DTYPES)}, got {cold_dtype!r}")
        _selector_kind(selector)

    @property
    def frames(self) -> int:
        return self.slots // self.page

    @property
    def bits(self) -> int | None:
        """Bits per code of an intN / rotN digest; None for exact (the keys) and quest (page bounds)."""
        kind, bits = _selector_kind(self.selector)
        return bits

    @property
    def rotate(self) -> bool:
        return _selector_kind(self.selector)[0] == "rot"


# the selector names: one list (selector_names.py) for this cache and the masked reference
SELECTOR_HELP = selector_names.SELECTOR_HELP
_selector_kind = selector_names.selector_kind


def recall_slots(spec: str, slots: int) -> int:
    """--recall: a count of slots (64) or a share of the budget written with a point or exponent
    (0.5, 5e-1), read as --budget is (sizes.parse_share_or_count)."""
    text = str(spec).strip()
    try:
        value = parse_share_or_count(text, "--recall")
    except ValueError:
        raise ValueError(f"--recall takes a slot count (64) or a share of the budget (0.5), got {text!r}") from None
    count = round(value * slots) if isinstance(value, float) else value
    if not 0 < count < slots:
        raise ValueError(f"--recall {text} must leave the policy some of the {slots} slots and take at least one")
    return count


@dataclass(frozen=True)
class TierStats:
    """The cold tier of a whole cache (every layer, row and KV head), since it was allocated."""

    cold_pages: int  # pages held in the cold stores
    cold_tokens: int  # tokens held in the cold stores
    dropped_tokens: int  # tokens dropped by --cold-limit (oldest pages first)
    host_bytes: int  # cold stores' host memory (allocated)
    digest_device_bytes: int  # the page digests' device memory
    pages_copied: int  # pages brought into recall slots so far
    recalled_mass: float  # attention probability mass the queries gave to recalled tokens
    attended_mass: float  # all the attention mass of the same queries (slots + new tokens)

    @property
    def recalled_share(self) -> float:
        """The share of attention that went to recalled tokens."""
        return self.recalled_mass / self.attended_mass if self.attended_mass else 0.0


# state tensors whose empty value is -1 (token indices, positions, slot and page numbers)
_EMPTY_IS_MINUS_ONE = {"token_index", "positions", "cold_token_index", "cold_positions", "cold_encoded",
                       "frames_frame_page"}


class RecallLayer(H2OLayer):
    def allocate(self, batch, heads, head_dim, value_dim, dtype, device) -> None:
        config: RecallConfig = self.owner.recall
        hot = self.capacity
        self.capacity = hot + config.slots  # the base allocates every column ...
        try:
            super().allocate(batch, heads, head_dim, value_dim, dtype, device)
        finally:
            self.capacity = hot  # ... and its policy works on the first ``hot``
        cuda = self.device.type == "cuda"
        self.cold = ColdStore(batch, heads, head_dim, value_dim, config.page, dtype, cold_dtype=config.cold_dtype,
                              limit=config.cold_limit, pin=cuda, device=self.device)
        if config.selector == "quest":
            self.digest = PageBounds(batch, heads, head_dim, config.page, frames=self.cold.frames, device=self.device,
                                     dtype=dtype)
        else:
            self.digest = KeyCodes(batch, heads, head_dim, config.page, config.bits, frames=self.cold.frames,
                                   device=self.device, dtype=dtype, rotate=config.rotate)
        self.frames = RecallFrames(batch, heads, config.frames, self.device)
        self.recall_slots = RecallSlots(self.keys[:, :, hot:], self.values[:, :, hot:], self.token_index[:, :, hot:],
                                        self.positions[:, :, hot:])
        self.decode_steps = 0
        # attention statistics since allocation, per (sequence, KV head), weighted as the scores are
        # (each real query row's probabilities, summed over the group's query heads)
        self.recalled_mass = torch.zeros(batch, heads, dtype=torch.float32, device=self.device)
        self.attended_mass = torch.zeros(batch, heads, dtype=torch.float32, device=self.device)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The base's slots plus every tensor the recall step updates in place: the statistics, the
        cold store, the digest and the recall frames (first dimension: the batch row)."""
        state = super().state_tensors()
        if not self.is_initialized:
            return state
        state.update(recalled_mass=self.recalled_mass, attended_mass=self.attended_mass)
        for prefix, part in (("cold", self.cold), ("digest", self.digest), ("frames", self.frames)):
            state.update({f"{prefix}_{name}": tensor for name, tensor in part.state_tensors().items()})
        return state

    def reset_row(self, row: int) -> None:
        for name, tensor in self.state_tensors().items():
            tensor[row] = -1 if name in _EMPTY_IS_MINUS_ONE else 0

    def reset(self) -> None:
        super().reset()
        self.cold = self.digest = self.frames = self.recall_slots = None
        self.recalled_mass = self.attended_mass = None

    def stats(self):
        """The base's, over every device slot: capacity counts the recall slots too (the budget), so
        ``held`` (hot and recalled tokens) never exceeds it."""
        return replace(super().stats(), capacity=self.capacity + self.owner.recall.slots)

    def recalled_token_index(self) -> torch.Tensor:
        """[B, H, R]: the token index each recall slot holds (-1: empty)."""
        return self.token_index[:, :, self.capacity:]

    def _choose_eviction(self):
        """The torch rules, or on Triton the kernel's eviction of a priority computed in torch; never
        the fused launch: it ranks every column, and the slot it empties must go cold first."""
        if kernels.kernel_backend(self.device) == "torch":
            return self._evict_by_torch_priority
        return self._evict_by_kernel_priority

    # -- recall before the attention ---------------------------------------------------------------
    def attend(self, query, key, value, new_valid, scale) -> torch.Tensor:
        batch, q_heads, q_len, head_dim = query.shape
        kv_heads = key.shape[1]
        every = self.owner.recall.every
        if not self.owner.compiled_step:  # (a compiled step's room is reserved by RecallCache.position_ids)
            self.reserve(q_len)
            self.decode_steps += q_len == 1
        # no branch on the cold store's contents: with no page to recall the plan loads nothing
        if q_len > 1 or every == 1 or (self.decode_steps - 1) % every == 0:
            queries = query.reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, head_dim)
            self.recall(queries)
        # every real query row's probabilities sum to 1 over slots + new tokens; weighted as the scores
        weights = row_weights(new_valid, batch, q_len, self.rows.decay, query.device)
        rows = weights.sum(dim=1, keepdim=True) if weights is not None else q_len
        self.attended_mass += rows * (q_heads // kv_heads)
        return super().attend(query, key, value, new_valid, scale)

    def recall(self, queries: torch.Tensor) -> None:
        """The best pages for these queries [B, H, M, D] into the recall columns."""
        # eager: score only the slots a token can be in (the store grows by doubling: up to half is
        # empty); a compiled step scores them all (a host count in the graph would compile every step)
        upto = None if self.owner.compiled_step else self.tokens_fed_with_padding
        wanted = self.digest.top_pages(queries, self.frames.frame_page.shape[-1], upto=upto)
        plan = self.frames.update(wanted, self.digest.count // self.cold.page)  # (the digest counts on the device)
        fill_recall_slots(self.recall_slots, self.cold, plan, self.owner.rotary)

    # -- the policy never sees the recall columns ----------------------------------------------------
    def _insert(self, key, value, new_scores, new_valid, step) -> None:
        recall_scores = self.scores[:, :, self.capacity:]  # zero before the attention: this step's mass
        self.recalled_mass += recall_scores.sum(dim=-1)
        recall_scores.zero_()  # what recalled tokens drew this step ranks nothing
        super()._insert(key, value, new_scores, new_valid, step)

    # -- evicted tokens go to the cold tier ------------------------------------------------------------
    def reserve(self, q_len: int) -> None:
        """Room in the cold store and the digest for whatever the next ``q_len`` tokens can evict (an
        upper bound from host counters: every token fed so far and these), so the step reads nothing back."""
        needed = self.tokens_fed_with_padding + q_len
        self.cold.reserve(needed)
        self.digest.reserve(needed)

    def _to_cold(self, keys, values, token_index, positions) -> None:
        self.cold.append(keys, values, token_index, positions, reserve=False)
        self.digest.append(keys, token_index, reserve=False)

    def _lowest_goes_cold(self, priority: torch.Tensor) -> torch.Tensor:
        """The priority with the recall columns never evicted (+inf), after sending the slot it evicts
        (the lowest, ties to the lowest slot, as torch's argmin and the eviction kernel choose) to the
        cold tier."""
        priority = priority.clone()
        priority[:, :, self.capacity:] = float("inf")
        where = (self.batch_rows, self.head_columns, priority.argmin(dim=-1))
        self._to_cold(self.keys[where].unsqueeze(2), self.values[where].unsqueeze(2),
                      self.token_index[where].unsqueeze(2), self.positions[where].unsqueeze(2))
        return priority

    def _overwrite_lowest(self, priority, key, value, new_score, token_index, position, value_norm):
        return super()._overwrite_lowest(self._lowest_goes_cold(priority), key, value, new_score, token_index,
                                         position, value_norm)

    def _evict_by_kernel_priority(self, key, value, new_score, token_index, position, value_norm,
                                  active=None) -> None:
        """The base's Triton route with the priority of ``_lowest_goes_cold`` (no row mask: every row
        takes every step, ``masks_inactive_rows``)."""
        mass = self.scores.sum(dim=-1)
        priority = self._lowest_goes_cold(self.priority(self.scores, self.token_index, token_index, self.value_norm))
        dropped, dropped_score = kernels.evict_and_insert(
            priority, self.keys, self.values, self.scores, self.token_index, self.positions, key, value, new_score,
            token_index, position, self.value_norm, value_norm)
        self._count_one_eviction(dropped, dropped_score, mass)

    def _select(self, key, value, new_scores, token_index, positions, value_norm) -> None:
        batch, heads, q_len, _ = key.shape
        used = self.slots_in_use
        expand = (batch, heads, q_len)
        cand_index = torch.cat([self.token_index[:, :, :used], token_index.unsqueeze(1).expand(expand)], dim=2)
        cand_keys = torch.cat([self.keys[:, :, :used], key.to(self.keys.dtype)], dim=2)
        cand_values = torch.cat([self.values[:, :, :used], value.to(self.values.dtype)], dim=2)
        cand_positions = torch.cat([self.positions[:, :, :used], positions.unsqueeze(1).expand(expand)], dim=2)
        super()._select(key, value, new_scores, token_index, positions, value_norm)
        kept = self.token_index[:, :, : self.capacity]
        dropped = (cand_index >= 0) & ~(cand_index.unsqueeze(-1) == kept.unsqueeze(-2)).any(-1)
        # in token order, as a cache fed one token at a time would have evicted them
        order = cand_index.masked_fill(~dropped, torch.iinfo(torch.long).max).argsort(dim=-1)

        def take(t):
            return t.gather(2, order if t.dim() == 3 else order.unsqueeze(-1).expand(*order.shape, t.shape[-1]))

        self._to_cold(take(cand_keys), take(cand_values), take(cand_index.masked_fill(~dropped, -1)),
                      take(cand_positions))


class RecallCache(H2OCache):
    """``H2OCache`` with a cold tier and R recall slots per layer (see the module's docstring)."""

    layer_type = RecallLayer
    masks_inactive_rows = False  # a step's evictions go to the cold tier: every row takes every step

    def __init__(self, num_layers, policy, slots, *, recall: RecallConfig, **kwargs):
        if kwargs.get("rows"):
            raise ValueError("recall serves one policy for every row (not eval's mixed rows)")
        self.recall = recall
        super().__init__(num_layers, policy, slots, **kwargs)
        if self.grows:
            raise ValueError("the full policy evicts nothing: recall needs an evicting policy")

    def tier_stats(self) -> "TierStats":
        """What the cold tier holds and did, summed over layers, rows and KV heads (reads the device)."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        pages = tokens = dropped = 0
        for layer in layers:
            first, end = layer.cold.held()
            pages += int((end - first).sum())
            tokens += int(layer.cold.held_tokens().sum())
            dropped += int(layer.cold.dropped().sum())
        return TierStats(
            cold_pages=pages, cold_tokens=tokens, dropped_tokens=dropped, host_bytes=self.cold_bytes(),
            digest_device_bytes=self.digest_bytes(),
            pages_copied=sum(int(layer.frames.copied.sum()) for layer in layers),
            recalled_mass=sum(float(layer.recalled_mass.sum()) for layer in layers),
            attended_mass=sum(float(layer.attended_mass.sum()) for layer in layers))

    def compile_blocker(self) -> str | None:
        """The compiled decode step takes recall on a CPU with --recall-every 1 (the step reads no host
        value: room is reserved before it, see ``position_ids``)."""
        blocker = super().compile_blocker()
        if blocker is not None:
            return blocker
        if self.recall.every > 1:
            return "--recall-every above 1 decides on the host which steps recall"
        if self.initialized and self.layers[0].device.type != "cpu":
            return "recall on an accelerator runs eagerly: its cold store is host memory (see recall/step.py)"
        return None

    def position_ids(self, batch: int, q_len: int, *args, **kwargs) -> torch.Tensor:
        """The base's, then room in every layer's cold store and digest for what these tokens can
        evict (decided here, before the step, from host counters: the step itself grows nothing)."""
        position_ids = super().position_ids(batch, q_len, *args, **kwargs)
        for layer in self.layers:
            if layer.is_initialized:
                layer.reserve(q_len)
        return position_ids

    def _apply_renumbering(self, renumbering, layers) -> None:
        """The base moves every slot column, the recall columns included (their positions count among
        the held ones, and their keys are rotated like the hot ones); the cold stores follow with the
        same function, so a token has one position wherever it sits, and the page digests are rebuilt
        from the cold keys at their new positions."""
        super()._apply_renumbering(renumbering, layers)
        for layer in layers:
            layer.cold.renumber(renumbering)
            if self.rotary is not None:  # the digests score keys as they will be attended: at their new positions
                layer.digest.rebuild(layer.cold.keys_by_slot(self.rotary))

    def cold_bytes(self) -> int:
        """Host bytes of the cold stores."""
        return sum(layer.cold.nbytes() for layer in self.layers if layer.is_initialized)

    def digest_bytes(self) -> int:
        """Device bytes of the page digests."""
        return sum(layer.digest.nbytes() for layer in self.layers if layer.is_initialized)

    def tier_record(self) -> dict:
        """What the cold tier holds and did, for ``--json`` records: recall slots per layer (part of the
        device budget), the digests' device bytes, the cold stores' host bytes, pages copied in."""
        stats = self.tier_stats()
        return {"recall_slots": self.recall.slots, "page": self.recall.page, "selector": self.recall.selector,
                "digest_device_bytes": stats.digest_device_bytes, "cold_host_bytes": stats.host_bytes,
                "pages_copied": stats.pages_copied}
