"""h2ochat's fixed KV budget inside vLLM: a ``vllm.general_plugins`` plugin, its own distribution.

Each request keeps at most a budget of KV blocks: its first blocks (sinks), a recent window and the
heavy blocks, ranked by the attention their tokens received, summed over heads, and with recall the
evicted blocks its queries need most. Evicted blocks go back to vLLM's block pool. The pieces, each in its own module:

- ``settings``: the budget, policy and recall options, read from vLLM's configuration or environment;
- ``choice``: which blocks of one request go, by h2ochat's policies (pure torch, no vLLM);
- ``scores``: the per-block attention a step's queries give, in plain torch (no vLLM);
- ``worker_state``: what a worker process holds for one step between the connector and the attention backend;
- ``cold_blocks``: recall on a worker: evicted blocks kept in host memory, and each step's recalled ones
  copied into the request's recall slots, per layer and KV head, by h2ochat's page selector;
- ``rest``: a prompt chunk's attention over every cold block besides the kept ones;
- ``backend``: vLLM's CPU attention backend, with evicted blocks compacted out of each request's
  block table and the block scores accumulated;
- ``connector``: a KV connector, the channel vLLM already has between scheduler and workers: scores
  come back aggregated over tensor-parallel ranks, evictions go out in the step's metadata;
- ``cpu_threads``: the CPU worker keeps the compute cores vLLM alone gives it (vLLM holds one back per
  worker for any KV connector's transfer thread; this one has none);
- ``reference``: a block-level masked reference in plain transformers, what the tests compare with.

Nothing here imports vLLM at import time: ``register`` (the entry point) does, when vLLM loads it.
"""

from __future__ import annotations

CONNECTOR_NAME = "H2OConnector"


def register() -> None:
    """vLLM's general-plugin hook, run in every vLLM process: the CPU attention backend is replaced
    by one that honours evictions (identical to it when no eviction is configured), the connector is
    made known by name, and the CPU executor reserves cores for it as for no connector."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .cpu_threads import keep_cores_for_compute

    keep_cores_for_compute(CONNECTOR_NAME)  # the connector moves no KV: no core held back for a transfer thread
    register_backend(AttentionBackendEnum.CPU_ATTN, "h2ochat_vllm.backend.H2OCPUAttentionBackend")
    if CONNECTOR_NAME not in KVConnectorFactory._registry:  # the hook may run twice in one process
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "h2ochat_vllm.connector", "H2OConnector")
