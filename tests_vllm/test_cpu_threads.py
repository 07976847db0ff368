"""The CPU worker's thread binding with the plugin's connector equals vLLM's without a connector;
other connectors keep vLLM's extra reserve; a user's reserve still decides."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from h2ochat_vllm import CONNECTOR_NAME
from h2ochat_vllm.cpu_threads import keep_cores_for_compute


def config(connector: str | None, workers: int = 2):
    parallel = SimpleNamespace(local_world_size=workers, data_parallel_rank_local=None, _api_process_count=1)
    transfer = None if connector is None else SimpleNamespace(kv_connector=connector)
    return SimpleNamespace(parallel_config=parallel, kv_transfer_config=transfer)


@pytest.fixture
def manager(monkeypatch):
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the reserve is counted, no core is bound
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr(OMPProcessManager, "__init__", OMPProcessManager.__init__)  # undone after the test
    keep_cores_for_compute(CONNECTOR_NAME)
    keep_cores_for_compute(CONNECTOR_NAME)  # twice, as vLLM may load the plugin twice: wrapped once
    return OMPProcessManager


@pytest.mark.parametrize("workers", [1, 2])
def test_the_plugin_reserves_as_vllm_alone(manager, workers):
    alone = manager(config(None, workers)).reserve_cpu_num
    assert manager(config(CONNECTOR_NAME, workers)).reserve_cpu_num == alone
    # a connector that transfers KV keeps vLLM's extra core per worker for its thread
    assert manager(config("NixlConnector", workers)).reserve_cpu_num == alone + workers


def test_a_users_reserve_still_decides(manager, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "3")
    assert manager(config(CONNECTOR_NAME)).reserve_cpu_num == 3
