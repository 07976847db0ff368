"""The CPU worker's compute threads: as many with the plugin's connector as without it.

vLLM's CPU executor (``vllm.utils.ompmultiprocessing.OMPProcessManager``, used by ``vllm serve`` and
any multi-process engine) binds each worker's OpenMP threads to the machine's cores minus a reserve
for the scheduler process. When any KV connector is configured it reserves one more core per worker,
meant for NIXL's transfer thread in prefill/decode disaggregation. h2ochat's connector transfers
nothing and runs no thread of its own, yet it got that reserve too. Where the cores are few the
extra reserve does not fit (2 cores: 2 reserved of 2), vLLM then reserves none, and the worker's
threads share every core with the busy-polling scheduler and the API server: each decode step waits
on OpenMP threads that are descheduled, several times slower than vLLM alone, which keeps a core for
them. Elsewhere it costs the worker a core that vLLM alone would compute on.

``keep_cores_for_compute`` makes vLLM count the reserve as it would without a connector when the
connector is h2ochat's alone. A user's ``VLLM_CPU_NUM_OF_RESERVED_CPU`` still decides, as in vLLM.
"""

from __future__ import annotations

import functools


class _WithoutConnector:
    """A view of a vLLM config that reads as if no KV connector were configured."""

    kv_transfer_config = None

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)


def reserves_like_vllm_alone(config, connector_name: str) -> bool:
    """Whether the CPU core reserve should be vLLM's own: the one connector is ``connector_name``."""
    transfer = getattr(config, "kv_transfer_config", None)
    return transfer is not None and getattr(transfer, "kv_connector", None) == connector_name


def keep_cores_for_compute(connector_name: str) -> None:
    """Wrap vLLM's OpenMP process manager once (idempotent; nothing on a vLLM without one)."""
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager
    except ImportError:  # a vLLM without the CPU executor's thread binding: nothing to correct
        return
    original = OMPProcessManager.__init__
    if getattr(original, "_h2ochat", False):
        return

    @functools.wraps(original)
    def __init__(self, config):
        original(self, _WithoutConnector(config) if reserves_like_vllm_alone(config, connector_name) else config)

    __init__._h2ochat = True
    OMPProcessManager.__init__ = __init__
