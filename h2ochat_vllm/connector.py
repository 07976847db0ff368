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
from .settings import read_settings
from .worker_state import STATE, RequestPlan


KEEP_FINISHED = 256
LOG_EVERY = 64  # finished requests between two summary lines in the server's log
logger = init_logger("vllm.h2ochat_vllm")  # under vLLM's logger, whose handler prints INFO


@dataclass
class H2OPlan(KVConnectorMetadata):
    plans: dict[str, RequestPlan]
    score_queries: int = 0
    score_every: int = 1


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
    computed: int = 0
    most_held: int = 0  # the most blocks held after a step's evictions
    most_held_decoding: int = 0  # the same over the steps that decode one token

    def summary(self) -> dict:
        return {"evicted": sorted(self.evicted), "most_held": self.most_held,
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


class H2OConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = read_settings(self._kv_transfer_config.kv_connector_extra_config,
                                      vllm_config.additional_config)
        self.block_size = vllm_config.cache_config.block_size
        self.budget = self.settings.blocks(self.block_size)
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
            STATE.set_plans(kv_connector_metadata.plans, kv_connector_metadata.score_queries,
                            kv_connector_metadata.score_every)
        else:
            STATE.set_plans({})

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
            self.finished[request.request_id] = record.summary()
            while len(self.finished) > KEEP_FINISHED:
                self.finished.popitem(last=False)
            self.finished_count += 1
            self.most_held_decoding = max(self.most_held_decoding, record.most_held_decoding)
            if self.finished_count % LOG_EVERY == 0:
                logger.info("h2ochat: %d requests finished; most blocks one request held while decoding: %d "
                            "(budget %d); blocks evicted: %d", self.finished_count, self.most_held_decoding,
                            self.budget.slots, self.evicted_total)
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
        freed = []
        for req_id, computed in self._scheduled(scheduler_output):
            step_tokens = scheduler_output.num_scheduled_tokens[req_id]
            total = computed + step_tokens
            record = self.requests.get(req_id)
            if record is None or computed < record.computed:  # new, or preempted and computed again from the start
                record = self.requests[req_id] = RequestBlocks()
            record.computed = computed
            blocks = manager.req_to_blocks[req_id]
            logical = -(-total // size)
            held = [j for j in range(logical) if j not in record.evicted]
            for j in blocks_to_evict(self.settings.policy, self.budget, record.padded(logical), held, computed // size):
                freed.append(blocks[j])
                blocks[j] = manager.block_pool.null_block
                record.evicted.add(j)
            holding = sum(1 for block in blocks[:logical] if not block.is_null)  # as vLLM's own table says
            record.most_held = max(record.most_held, holding)
            if step_tokens == 1:
                record.most_held_decoding = max(record.most_held_decoding, holding)
            plans[req_id] = RequestPlan(blocks[(total - 1) // size].block_id, tuple(sorted(record.evicted)))
        if freed:
            manager.block_pool.free_blocks(freed)
            self.evicted_total += len(freed)
        return H2OPlan(plans, self.settings.score_queries, self.settings.score_every)
