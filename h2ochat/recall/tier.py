"""The recall tier of one layer (``RecallTier``, the ``kv.tier.Tier`` contract) and its spec for a
whole cache (``RecallSpec``): the layer's R extra slot columns hold recalled pages, evicted tokens go
to a cold store and its device digest.

A token the policy evicts is archived before its slot is overwritten: a decode step's victim
(``archive``: the one the layer's eviction then writes over) waits on the staging page, the last P
of the R recall columns (``step.StagingPage``), which goes to the cold store and the digest every P
decode steps (``flush``); a chunk's dropped candidates (``archive_dropped``) go straight there, in
token order, after the staging page. Staged tokens are attended exactly (their columns are slots);
the selector scores the flushed pages.

The choice of pages runs before a step, eagerly (``reserve``, called by ``H2OCache.position_ids``):
every prefill chunk chooses with all its queries (the group's query heads times its tokens, in
``before_attention``), a decode step every ``every``-th step counted from the last flush: with its
own queries (in ``before_attention``, an eager step's on a CPU or a GPU alike; a CPU's compiled step calls
the same choice as an op of its graph, ``graph_choice``), or, by the "before" rule only
(``RecallConfig.decode_rule``, ``RecallConfig.chooses_before``: for a captured graph that can call no op
back), before the step with the last step's queries (prefetch: the pages a step picks are loaded for the
next one, as FreeKV and ArkVale do; the one-step lag lost held-out keys, so the default does not
prefetch). The best R / P - 1 pages go into the recall frames
(``RecallFrames``: a page already there is not copied again). Hot, recalled and staged tokens share one
softmax; the recall columns' scores are cleared before each eviction (they rank nothing).

Compact positions: a re-numbering moves the recall columns with the hot ones (the layer's slots);
the cold store's positions follow with the same function (a cold token takes the number of the first
held position after it) and the digest is re-encoded from the cold keys at their new positions
(RoPE), so pages are scored as they will be attended.

Quantized slots (``--kv-dtype int8/int4``, ``kv.slot_format``): the recall and staging columns are
the layer's, so they hold codes with per-slot scales and offsets. A victim is staged with its codes
and scales; the cold store and the digest take the dequantized floats (int4 keys back in the model's
frame, un-turned); a recalled page is encoded as the layer encodes new tokens, which gives back the
codes it held (min-max codes of their own dequantized values: the same, up to float rounding). After
a re-numbering the digest is rebuilt from the moved cold keys encoded and decoded so, as a recalled
page will attend them.

``--recall-rest``: the cold pages not recalled join the attention as one column, computed eagerly after the
choice (``before_attention`` returns it: ``rest``) in the steps the mode names (``RecallConfig.rest_attended``,
the same on every machine): by the choice's C call where it runs, chunks' too, else by the torch route.

On a CPU (a bf16 or fp32 model; AVX512-BF16 or the portable build) the eager decode step's choice of pages
(scores, plan and copy) with its rest, its staging and a flush's append are each one C call a layer
(``native``), rows left out and int8 slots included; elsewhere the torch routes below.

A server's bucket (a cache over the first k rows, ``H2OCache.prefix``) steps these tiers themselves: a port
of k rows (``TierPort.batch``) is a decode step of the first k with the rows after them left out (their clocks,
stores, frames and slots untouched). A prompt chunk comes through a cache of its own, never a bucket.

The decode step's graph reads no host value and touches no store that grows: one static graph whatever
the length and the cadence (flush, cadence, growth and re-numbering run before it; the choice of pages, an
opaque op, inside it). On a GPU the cold store is pinned host memory (``step``, ``cold_store``).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import replace

import torch
from h2ochat_kernels.cpu import recall_ops as native
from h2ochat_kernels.cpu.decode_choice import DecodeChoice, PageMeans
from h2ochat_kernels.reference import row_weights

from .bounds import PageBounds
from .cold_keys import ColdKeys
from .cold_store import ColdStore
from . import graph_choice
from .layout import tensor_bytes
from .digests import KeyCodes
from .two_stage import TwoStageCodes
from .rest import rest_column
from .row_cadence import RowCadence
from .selector_names import resolved_selector
from .step import RecallFrames, RecallPlan, RecallSlots, StagingPage, fill_recall_slots, host_reads_allowed
from .tier_rows import RecallRowMoves, rows_kept
from .cold_writes import ColdWrites
from .tiered import RecallConfig

NO_STAGER = (lambda: None, None)  # (``RecallTier._stager``'s last port before any: a dead reference)


def leading(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor``'s first ``rows`` rows: itself when that is all of them (an eager slice costs an op, ~5 us a layer;
    a compiled step slices, as a test of its symbolic batch would guard its graph on the batch)."""
    return tensor if not torch.compiler.is_compiling() and rows == tensor.shape[0] else tensor[:rows]


# state tensors whose empty value is -1 (slot and page numbers, the cold tokens' indices and positions)
_EMPTY_IS_MINUS_ONE = {"cold_token_index", "cold_positions", "cold_encoded", "frames_frame_page"}


class RecallTier(RecallRowMoves, ColdWrites):
    """One layer's cold store, digest, recall frames, staging page and attention statistics."""

    archives = True

    def __init__(self, config: RecallConfig):
        self.config = config
        self.columns = config.slots
        self.reset()

    # -- the layer's allocation and state -----------------------------------------------------------
    def allocate(self, port, batch, heads, head_dim, value_dim, dtype, device) -> None:
        config = self.config
        self.cold = ColdStore(batch, heads, head_dim, value_dim, config.page, dtype, cold_dtype=config.cold_dtype,
                              limit=config.cold_limit, pin=device.type == "cuda", device=device)
        in_place = ColdKeys.fits(self.cold, device)
        config = replace(config, selector=resolved_selector(config.selector, in_place))  # (auto: what it stands for)
        self.selector = config.selector
        if self.selector == "exact" and in_place:  # the store's own keys, not a copy
            self.digest = ColdKeys(self.cold, backend=port.kernels)
        elif self.selector == "quest":
            self.digest = PageBounds(batch, heads, head_dim, config.page, frames=self.cold.frames, device=device,
                                     dtype=dtype)
        elif config.bits is not None and config.summary_cap is not None:  # token codes beside the cold store
            self.digest = TwoStageCodes(batch, heads, head_dim, config.page, config.bits, frames=self.cold.frames,
                                        device=device, host=self.cold.count.device, dtype=dtype,
                                        rotate=config.rotate, backend=port.kernels, cap=config.summary_cap,
                                        candidates=config.candidates)
        else:
            self.digest = KeyCodes(batch, heads, head_dim, config.page, config.bits, frames=self.cold.frames,
                                   device=device, dtype=dtype, rotate=config.rotate, backend=port.kernels)
        self.frames = RecallFrames(batch, heads, config.frames - 1, device)  # (the last page stages)
        # the layer's slot format (``kv.slot_format``): quantized slots hold codes with scales beside
        # them; the cold store and the digest take their floats (``decoded``)
        self.format = port.format
        # views of the tier's columns of the layer's slots (the port says where): attended with the hot ones
        self.slots = RecallSlots.of(port.frame_columns(config.page), self.format)
        self.staging = StagingPage(RecallSlots.of(port.staging_columns(config.page), self.format), device)
        # a CPU decode step's whole choice (and rest) in one C call, where it runs (``native_choice``)
        self.stagers = weakref.WeakKeyDictionary()  # port -> the C staging of its columns or None (``_stager``)
        self._last_stager = NO_STAGER  # (the last port asked for, weakly, and its stager)
        self.decode_choice = DecodeChoice.of(self.cold, self.frames, self.slots.columns(), isinstance(self.digest, ColdKeys))
        self.page_means = PageMeans(batch, heads, value_dim, self.decode_choice is not None and config.rest != "off")
        self.cadence = RowCadence(batch, config.page, config.every)  # each row's flush and choice, on its own count
        self.step_active = None  # the decode step's active rows [B] (None: every row), for ``archive``
        columns = port.tier_columns()
        self.all_columns, self.recall_scores = columns["token_index"], columns["scores"]
        self.decode_steps = 0
        self.prepared_at = None  # the layer's column count when ``reserve`` prepared the step
        # the last step's queries [B, H, G, D] (its last token's), for a choice before the step (allocated
        # by the first step, which knows the query group)
        self.last_query = None
        self.has_query = False
        self.choose_in_step = False  # this decode step chooses its pages with its own queries (eager)
        # a static-shape cache's decode step chooses before it, with the last step's queries, by the "before"
        # rule only; else in the step with its own, eager on any device or inside a CPU's compiled step
        # (``graph_choice``: the port and rotary of the step it prepared). No recall step is captured on an
        # accelerator (``RecallSpec.compile_blocker``): an eager GPU step chooses in the step, as a CPU's does
        self.prefetches = config.chooses_before(device.type, captured=False)
        self.prepared_step = None
        # attention statistics since allocation, per (sequence, KV head), weighted as the scores are
        # (each real query row's probabilities, summed over the group's query heads)
        self.recalled_mass = torch.zeros(batch, heads, dtype=torch.float32, device=device)
        self.attended_mass = torch.zeros(batch, heads, dtype=torch.float32, device=device)

    @property
    def batch(self) -> int:
        """The rows this tier holds (a step of a prefix cache's port runs the first of them)."""
        return self.recalled_mass.shape[0]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the recall step updates in place (first dimension: the batch row), beside the
        layer's slots (which hold the recall and staging columns): a compiled step's graph and a
        parked row take them."""
        if self.cold is None:
            return {}
        state = {"recalled_mass": self.recalled_mass, "attended_mass": self.attended_mass}
        if self.last_query is not None:
            state["last_query"] = self.last_query
        for prefix, part in (("cold", self.cold), ("digest", self.digest), ("frames", self.frames),
                             ("staging", self.staging)):
            state.update({f"{prefix}_{name}": tensor for name, tensor in part.state_tensors().items()})
        return state

    def empty_value(self, name: str) -> int:
        return -1 if name in _EMPTY_IS_MINUS_ONE else 0

    def reset(self) -> None:
        self.cold = self.digest = self.frames = self.slots = self.staging = self.recall_scores = self.page_means = None
        self.decode_choice, self.stagers, self._last_stager = None, weakref.WeakKeyDictionary(), NO_STAGER
        self.selector = self.config.selector  # (``auto`` resolved when allocated: ``resolved_selector``)
        self.recalled_mass = self.attended_mass = self.last_query = self.all_columns = None

    def bookkeeping_bytes(self) -> int:
        """Device bytes of the frames' bookkeeping, the last queries and the attention statistics."""
        return tensor_bytes([*self.frames.state_tensors().values(), self.recalled_mass, self.attended_mass]
                            + ([self.last_query] if self.last_query is not None else []))

    def host_bytes_per_token(self) -> float:
        """Host bytes one cold token of one row takes in this layer, over its KV heads: the cold store's, the
        token codes' beside it (a slot per token, and the spill slot) and the rest's page means."""
        batch, means = self.cold.count.shape[0], self.page_means.bytes_per_token(self.cold.page)
        parts = [(self.cold.nbytes(), self.cold.capacity), (self.digest.host_nbytes(), self.digest.capacity)]
        return sum(nbytes / (batch * (capacity + 1)) for nbytes, capacity in parts if nbytes) + means

    def recalled_token_index(self) -> torch.Tensor:
        """[B, H, R]: the token index each recall slot holds, staging page included (-1: empty)."""
        return self.all_columns

    # -- before the step (eager, host counters only) ----------------------------------------------------
    def reserve(self, port, q_len: int, context) -> None:
        """Before a step (``H2OCache.position_ids``, eager for the compiled step too): the staging page goes
        to the cold tier before a chunk or when full, a decode step's choice is planned, and there is room
        for what a chunk can evict. Reads nothing back from the device."""
        self.prepared_at = port.tokens_fed_with_padding
        with torch.inference_mode(port.inference):  # (as the step that made the state ran)
            self._prepare(port, q_len, context)

    def _prepare(self, port, q_len: int, context) -> None:
        cadence = self.cadence
        if q_len > 1:
            if port.batch != self.batch:
                raise ValueError("a prefix of a recall cache's rows takes decode steps, not prompt chunks")
            self.step_active = None
            if self.cold.bound is None:  # (a bounded store makes the room its bound admits: ``ColdWrites``)
                self._room(port, max(cadence.steps) + q_len)  # (the staged pages, then what the chunk drops)
            self.flush(port, rows=cadence.staged())
            self.has_query = True
            return
        # (a prefix cache's step, ``H2OCache.prefix``: its port's first rows; the rows after them sit it out)
        mask = context.numbers.active if context.numbers is not None else None
        active = cadence.active(mask, port.batch)
        self.step_active = mask
        self.flush(port, rows=cadence.full())
        self.decode_steps += 1
        # the cadence counts from each row's last flush: every ``every`` steps, and at least once a page
        due = cadence.choosing(active)
        prefetch = context.static_shapes and self.prefetches  # (the compiled step's cache by the "before" rule)
        if due is not False and prefetch and self.has_query:
            self.recall(port, self.last_query, context.rotary, due)
        self.choose_in_step = False if prefetch else due
        if context.static_shapes and not prefetch:  # (a compiled step's op asks for this tier: ``choose_prepared``)
            self.prepared_step = port, context.rotary
            graph_choice.prepare(port.layer, self)
        cadence.count_step(active)
        self.staging.count_step()
        self.has_query = True

    # -- the step -------------------------------------------------------------------------------------
    def before_attention(self, port, query, new_valid, scale, context):
        """The step's choice of pages, then its rest column where attended (``RecallConfig.rest_attended``)."""
        batch, q_heads, q_len, head_dim = query.shape
        heads = self.recalled_mass.shape[1]
        group = q_heads // heads
        if not context.compiled and self.prepared_at != port.tokens_fed_with_padding:
            self.reserve(port, q_len, context)  # (a step not prepared by position_ids: transformers' generate())
        grouped = query.view(batch, heads, group, q_len, head_dim)
        if not context.compiled and (self.last_query is None or self.last_query.shape[2] != group):
            self.last_query = query.new_zeros(self.batch, heads, group, head_dim)
        attended = self.config.rest_attended(decoding=q_len == 1)
        rest = (scale, self.page_means) if attended and not context.compiled else None
        rest_done = False  # (a decode step's C call left the rest in ``decode_choice.rest``)
        if q_len > 1:  # a chunk chooses its pages with all its queries (any order: the best q.k), before attending
            rest_done = self.recall(port, grouped.reshape(batch, heads, group * q_len, head_dim), context.rotary, True, rest)
        elif context.compiled:  # a CPU graph holds the choice as an op (a fixed rule: no guard per step)
            if not self.prefetches:
                graph_choice.choose(grouped[:, :, :, 0], port.slot_tensors(), port.layer)
        elif self.choose_in_step is not False or rest is not None:  # an eager step: with its own queries
            rest_done = self.recall(port, grouped[:, :, :, 0], context.rotary, self.choose_in_step, rest)
        active = context.numbers.active if q_len == 1 else None  # (a row left out keeps its last queries)
        if self.prefetches:  # (only a choice before the step reads them: a CPU's in-step choice does not)
            last, kept = grouped[:, :, :, -1], self.last_query[:batch]
            kept.copy_(last if active is None else torch.where(active.view(-1, 1, 1, 1), last, kept))
        # every real query row's probabilities sum to 1 over slots + new tokens; weighted as the scores
        weights = row_weights(new_valid, batch, q_len, port.decay, query.device)
        rows = weights.sum(dim=1, keepdim=True) if weights is not None else q_len
        attended = leading(self.attended_mass, batch)
        if active is None:
            attended.add_(rows * group)
        else:
            attended.add_(active.view(-1, 1), alpha=group)  # (a row left out adds nothing)
        if rest is None or rest_done:  # (the C call's rest, or none attended)
            return self.decode_choice.rest_as(grouped.shape[:4]) if rest_done else None
        cold, frame_page = self.cold, self.frames.frame_page
        if batch < self.batch:
            cold, frame_page = cold.first_rows(batch), frame_page[:batch]
        return rest_column(cold, frame_page, grouped, scale, context.rotary)

    def choose_prepared(self, queries: torch.Tensor, given: list[torch.Tensor]) -> None:
        """The compiled step's op (``graph_choice``), at run time: the eager step's choice for the step
        ``reserve`` prepared. ``given``: the layer's per-slot tensors as the graph handed them over; a
        copy of them (a functionalising backend's) is brought up to date with the buffers it copied."""
        port, rotary = self.prepared_step
        if self.choose_in_step is not False:
            already = torch.is_inference_mode_enabled() and port.inference  # (the compiled step's own mode)
            with contextlib.nullcontext() if already else torch.inference_mode(port.inference):
                self.recall(port, queries, rotary, self.choose_in_step)
        for tensor, own in zip(given, port.slot_tensors()):
            if tensor.data_ptr() != own.data_ptr():
                tensor.copy_(own)

    def recall(self, port, queries: torch.Tensor, rotary, rows: bool | list[bool] = True, rest=None) -> bool:
        """The best pages for these queries [B, H, M, D] into the recall frames (eager); ``rows`` (a
        boolean per row, or False: none): only those rows' frames change, the others keep their pages and
        clocks. Returns whether the C call ran, which with ``rest`` (scale, page means) left the rest in
        ``decode_choice``."""
        fused = self.decode_choice if rotary is None or not self.cold.moved else None
        if fused is not None and fused(queries, self.digest.scored_slots(port.tokens_fed_with_padding), rows, rest):
            return True
        if rows is False:
            return False
        if self._nothing_flushed_yet():  # (the frames' clock still counts the choice, as update would)
            self.frames.tick(rows)
            return False
        # the first rows only: a prefix cache's step runs its first rows (the others sit it out), and where the
        # plan is read on the host (a CPU) only those up to the last one choosing (a server's rows in use sit at
        # the front: a free row's empty store is not scored as far as the longest row's)
        chosen = queries.shape[0]
        if rows is not True and host_reads_allowed(self.frames.frame_page):
            chosen = max((row for row, due in enumerate(rows[:chosen]) if due), default=-1) + 1
        digest, frames, cold, slots = self.digest, self.frames, self.cold, self.slots
        if chosen < self.batch:
            digest, frames, cold, slots = (part.first_rows(chosen) for part in (digest, frames, cold, slots))
            queries, rows = queries[:chosen], rows if rows is True else rows[:chosen]
        # score only the slots a token can be in (the store grows by doubling: up to half is empty)
        wanted = digest.top_pages(queries, frames.frame_page.shape[-1], upto=port.tokens_fed_with_padding)
        if rows is True or all(rows):
            plan = frames.update(wanted, digest.count // cold.page)  # (the digest counts on the device)
        else:
            still = torch.tensor([not row for row in rows], device=wanted.device)
            with rows_kept(frames, still):
                plan = frames.update(wanted, digest.count // cold.page)
            plan = RecallPlan(plan.frame_page, plan.load & ~still.view(-1, 1, 1))
        fill_recall_slots(slots, cold, plan, rotary, self.format)
        return False

    def _nothing_flushed_yet(self) -> bool:
        """No row has a cold page yet, read on the host where allowed: a choice would load nothing."""
        return host_reads_allowed(self.cold.count) and not bool(self.cold.count.any())

    def before_insert(self, port) -> None:
        """The recall columns' scores are this step's attention to recalled and staged tokens:
        counted, then cleared (what they drew ranks nothing)."""
        scores = self.recall_scores
        if torch.compiler.is_compiling():  # (views made in the graph, not inputs of it aliasing the slots)
            scores = port.tier_columns()["scores"]
        elif port.batch < self.batch:  # (a prefix cache's step: its first rows)
            scores = scores[:port.batch]
        leading(self.recalled_mass, scores.shape[0]).add_(scores.sum(dim=-1))
        scores.zero_()

    def archive(self, port, slot: torch.Tensor) -> None:
        """A decode step's victim into the staging page (``staging``: the cold tier takes it at the flush);
        a row left out of the step stages nothing (its slot is not overwritten)."""
        stager = None if torch.compiler.is_compiling() else self._stager(port)  # (a compiled step: torch's)
        if stager is not None and stager(slot, self.step_active):
            return  # (float slots on a CPU: one C call, ``native.Stager``)
        victims, active = port.victims(slot), self.step_active
        if active is not None:
            victims["token_index"] = victims["token_index"].masked_fill(~active.view(-1, 1), -1)
        self.staging.put(port, victims, active)

    def _stager(self, port) -> "native.Stager | None":
        """The C staging for this port's columns (made for each port: the layer's, its prefixes'; again for
        a new port, new tensors), or None."""
        if self._last_stager[0]() is port:  # (every step of the same port asks: the lookup once)
            return self._last_stager[1]
        if port not in self.stagers:
            self.stagers[port] = native.Stager.of(port.policy_columns(), self.staging.slots.columns(), self.staging.count)
        self._last_stager = (weakref.ref(port), self.stagers[port])
        return self.stagers[port]

    def pages_recalled(self, row: int) -> int:
        """Pages brought into row ``row``'s recall slots in its conversation so far (every KV head)."""
        return int(self.frames.copied[row].sum()) if self.frames is not None else 0
