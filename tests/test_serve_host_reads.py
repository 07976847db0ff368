"""A steady decode step of the server (no request admitted, none finishing) reads the device once:
the sampled tokens of every row in one ``tolist`` (issue 35: no per-row host work in the step). Counted
by wrapping the tensor methods that copy a value to the host."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch

from conftest import FAMILIES, build_model
from serve_fakes import make_request
from h2ochat.config import CacheSettings
from h2ochat.serve.backend import ModelBackend
from h2ochat.serve.parked import ParkedStore
from h2ochat.serve.scheduler import Scheduler

HOST_READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """A Counter of 'file:line method' per host read while the fixture's ``counting`` flag is set."""
    reads = collections.Counter()
    state = {"counting": False}

    def wrapped(name, original):
        def read(self, *args, **kwargs):
            if state["counting"]:
                frame = traceback.extract_stack(limit=3)[-2]
                reads[f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} .{name}"] += 1
            return original(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, wrapped(name, getattr(torch.Tensor, name)))
    reads.state = state
    return reads


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["h2o", "mean"])
def test_a_steady_decode_step_reads_the_device_once(family, policy, host_reads):
    backend = ModelBackend(build_model(family, seed=0), CacheSettings(policy=policy, budget="12"), 4,
                           store=ParkedStore(1 << 24), prefill_chunk=8)
    scheduler = Scheduler(backend)
    for extra in range(3):  # prompts longer than the budget: the rows evict every step
        scheduler.submit(make_request(list(range(5, 22 + 3 * extra)), max_tokens=40, stop_ids=()))
    while scheduler.waiting or scheduler.job is not None:
        scheduler.step()
    assert scheduler.rows_in_use == 3
    steps = 10
    host_reads.state["counting"] = True
    for _ in range(steps):
        scheduler.step()
    host_reads.state["counting"] = False
    assert scheduler.rows_in_use == 3  # (no row finished: a steady step)
    assert sum(host_reads.values()) == steps, dict(host_reads)
    assert all("sampling.py" in where and where.endswith(".tolist") for where in host_reads), dict(host_reads)
