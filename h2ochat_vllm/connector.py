"""The KV connector that carries h2ochat's eviction between vLLM's scheduler and its workers.

Scheduler side: it reads each step's block scores (summed by vLLM over every worker, so over every
tensor-parallel rank's heads), keeps them per request and logical block, and at each schedule evicts
the lowest-ranked blocks of any request past its budget (``choice.blocks_to_evict``): the block
leaves the request's table in vLLM's KV cache manager (a null block takes its place, as vLLM's
sliding-window manager does) and returns to the block pool. The step's plan (per request, its row
marker and evicted logical blocks) goes to every worker in the step's connector metadata.

Worker side: it hands the plan to the attention backend before the attention metadata is built
(vLLM calls ``handle_preemptions`` with the metadata at the start of each step) and returns the
step's scores after it.

Configure with ``--kv-transfer-config '{"kv_connector": "H2OConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"budget": 1024}}'`` (see ``settings``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from vllm.logger import init_logger

from .choice import blocks_to_evict
from .cold_blocks import COLD, selector_for
from .settings import read_settings
from .worker_state import STATE, RequestPlan, StepOptions


KEEP_FINISHED = 256
LOG_EVERY = 64  # finished requests between two summary lines in the server's log
logger = init_logger("vllm.h2ochat_vllm")  # under vLLM's logger, whose handler prints INFO


@dataclass
class H2OPlan(KVConnectorMetadata):
    plans: dict[str, RequestPlan]
    options: StepOptions


@dataclass
class H2OScores(KVConnectorWorkerMetadata):
    scores: dict[str, list[float]]  # req id -> attention per logical block this step (plain lists: pickled cheaply)

    def aggregate(self, other: "H2OScores") -> "H2OScores":
        merged = dict(self.scores)
        for req_id, values in other.scores.items():
            mine = merged.get(req_id, [])
            longer, shorter = (values, mine) if len(values) >= len(mine) else (mine, values)
            merged[req_id] = [a + (shorter[i] if i < len(shorter) else 0.0) for i, a in enumerate(longer)]
        return H2OScores(merged)


@dataclass
class RequestBlocks:
    """The scheduler's record of one request: block scores, evicted blocks, tokens computed."""

    scores: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    evicted: set[int] = field(default_factory=set)
    cold: list[int] = field(default_factory=list)  # evicted blocks kept in the workers' host memory, in order
    slots: list[int] = field(default_factory=list)  # logical places (evicted ones) whose table entry is a recall slot
    computed: int = 0
    started: bool = False  # a plan has gone to the workers since the request (re)started
    most_held: int = 0  # the most blocks held after a step's evictions
    most_held_decoding: int = 0  # the same over the steps that decode one token

    def summary(self) -> dict:
        return {"evicted": sorted(self.evicted), "cold": list(self.cold), "most_held": self.most_held,
                "most_held_decoding": self.most_held_decoding}

    def add(self, step: list[float], decay: float) -> None:
        step_scores = torch.tensor(step, dtype=torch.float32)
        if self.scores.numel() < step_scores.numel():
            grown = torch.zeros(step_scores.numel())
            grown[: self.scores.numel()] = self.scores
            self.scores = grown
        self.scores.mul_(decay)
        self.scores[: step_scores.numel()] += step_scores

    def padded(self, length: int) -> torch.Tensor:
        out = torch.zeros(max(length, self.scores.numel()))
        out[: self.scores.numel()] = self.scores
        return out


def cold_block_bytes(kv_cache_config, world_size: int, selector) -> int:
    """Host bytes one cold block takes over every worker: the block's KV in every layer, on every
    tensor-parallel rank (each keeps its own heads), plus the selector's digest of its keys (the exact
    selector's is a copy of the keys: half the block again)."""
    if kv_cache_config is None:
        return 0
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        digest = 0.5 * selector.bytes_ratio(spec.block_size, spec.head_size)
        total += int(spec.page_size_bytes * (1 + digest)) * len(group.layer_names)
    return total * world_size


class H2OConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = read_settings(self._kv_transfer_config.kv_connector_extra_config,
                                      vllm_config.additional_config)
        self.block_size = vllm_config.cache_config.block_size
        self.budget = self.settings.blocks(self.block_size)
        self.recall_slots = self.settings.recall_blocks(self.block_size)
        selector = selector_for(self.settings.selector)
        COLD.use_selector(selector)  # a worker's connector starts before its first step: the workers rank by it
        # the workers' cold blocks, counted here where the decisions are made: at the bound, further evicted
        # blocks are dropped (as without recall) and those kept stay until their request ends
        block_bytes = cold_block_bytes(kv_cache_config, vllm_config.parallel_config.world_size, selector)
        self.cold_limit = self.settings.recall_memory // block_bytes if block_bytes else 0
        self.cold_total = 0
        self.cold_refused = 0
        self.requests: dict[str, RequestBlocks] = {}
        self.evicted_total = 0
        self.finished: OrderedDict[str, dict] = OrderedDict()  # the last requests' summaries, for tests and logs
        self.finished_count = 0
        self.most_held_decoding = 0  # over every request so far: the budget's proof in a server's log

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed to another instance

    # -- worker side ------------------------------------------------------------------------------
    def handle_preemptions(self, kv_connector_metadata) -> None:
        # called with the step's metadata before the attention metadata is built: the backend needs the plan then
        if isinstance(kv_connector_metadata, H2OPlan):
            STATE.set_plans(kv_connector_metadata.plans, kv_connector_metadata.options)
            for req_id, plan in kv_connector_metadata.plans.items():
                if plan.restarted:
                    COLD.forget(req_id)
        else:
            STATE.set_plans({})

    def get_finished(self, finished_req_ids: set[str]):
        for req_id in finished_req_ids:
            COLD.forget(req_id)
        return None, None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def build_connector_worker_meta(self):
        scores = STATE.take_scores()
        STATE.set_plans({})
        return H2OScores({req_id: s.tolist() for req_id, s in scores.items()}) if scores else None

    # -- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        return None

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, H2OScores):
            for req_id, step in meta.scores.items():
                record = self.requests.get(req_id)
                if record is not None:
                    record.add(step, self.settings.policy.decay)

    def request_finished(self, request, block_ids):
        record = self.requests.pop(request.request_id, None)
        if record is not None:
            self.cold_total -= len(record.cold)
            self.finished[request.request_id] = record.summary()
            while len(self.finished) > KEEP_FINISHED:
                self.finished.popitem(last=False)
            self.finished_count += 1
            self.most_held_decoding = max(self.most_held_decoding, record.most_held_decoding)
            if self.finished_count % LOG_EVERY == 0:
                logger.info("h2ochat: %d requests finished; most blocks one request held while decoding: %d "
                            "(budget %d, %d of them recall slots); blocks evicted: %d; cold blocks kept now: %d "
                            "(at most %d); evicted blocks not kept at that bound: %d", self.finished_count,
                            self.most_held_decoding, self.budget.slots + self.recall_slots, self.recall_slots,
                            self.evicted_total, self.cold_total, self.cold_limit, self.cold_refused)
        return False, None

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if len(kv_cache_manager.coordinator.single_type_managers) != 1:  # checked once, as the scheduler starts
            raise ValueError("h2ochat: the budget needs one KV cache group (one attention type in the model)")

    def _manager(self):
        return self._kv_cache_manager.coordinator.single_type_managers[0]

    def _scheduled(self, scheduler_output):
        for new in scheduler_output.scheduled_new_reqs:
            yield new.req_id, new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        yield from zip(cached.req_ids, cached.num_computed_tokens)

    def build_connector_meta(self, scheduler_output) -> H2OPlan:
        manager = self._manager()
        size = manager.block_size
        plans: dict[str, RequestPlan] = {}
        for req_id, computed in self._scheduled(scheduler_output):
            step_tokens = scheduler_output.num_scheduled_tokens[req_id]
            total = computed + step_tokens
            record = self.requests.get(req_id)
            if record is None or computed < record.computed:  # new, or preempted and computed again from the start
                if record is not None:
                    self.cold_total -= len(record.cold)
                record = self.requests[req_id] = RequestBlocks()
            record.computed = computed
            blocks = manager.req_to_blocks[req_id]
            logical = -(-total // size)
            held = [j for j in range(logical) if j not in record.evicted]
            to_cold, freed = [], []
            for j in blocks_to_evict(self.settings.policy, self.budget, record.padded(logical), held, computed // size):
                if self.recall_slots:
                    if self.cold_total < self.cold_limit:
                        to_cold.append((j, blocks[j].block_id))
                        record.cold.append(j)
                        self.cold_total += 1
                    else:
                        self.cold_refused += 1
                freed.append(blocks[j])
                blocks[j] = manager.block_pool.null_block
                record.evicted.add(j)
            if freed:
                manager.block_pool.free_blocks(freed)
                self.evicted_total += len(freed)
            self._add_recall_slots(record, blocks, manager.block_pool)
            holding = sum(1 for block in blocks[:logical] if not block.is_null)  # as vLLM's own table says
            record.most_held = max(record.most_held, holding)
            if step_tokens == 1:
                record.most_held_decoding = max(record.most_held_decoding, holding)
            plans[req_id] = RequestPlan(blocks[(total - 1) // size].block_id, tuple(sorted(record.evicted)),
                                        tuple(blocks[j].block_id for j in record.slots), tuple(to_cold),
                                        restarted=not record.started)
            record.started = True
        return H2OPlan(plans, self.settings.step_options())

    def _add_recall_slots(self, record: RequestBlocks, blocks: list, pool) -> None:
        """Give the request a recall slot per cold block, up to the recall share: a new block from the pool,
        put in the request's table at an evicted place (so vLLM frees it with the request, and counts it as the
        request's), never attended as that place's tokens: the workers copy recalled blocks into it."""
        wanted = min(self.recall_slots, len(record.cold)) - len(record.slots)
        wanted = min(wanted, pool.get_num_free_blocks())
        if wanted <= 0:
            return
        places = [j for j in record.cold if j not in record.slots][:wanted]
        for place, block in zip(places, pool.get_new_blocks(len(places))):
            blocks[place] = block
            record.slots.append(place)
