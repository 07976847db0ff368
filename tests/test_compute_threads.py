"""Which thread computes, with how many threads: a server's main thread hands its compute threads to the engine
thread and computes with one itself (``threads.handed_over``); its KV check runs in a thread that ends with it
(``threads.in_passing_thread``), so no second OpenMP pool outlives it (two pools on two CPUs made every worker
sleep between parallel regions: a served decode step took about twice as long)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from h2ochat import threads
from h2ochat.errors import UserError
from h2ochat.serve import server


def test_a_handed_over_thread_computes_with_one_thread_until_the_block_ends():
    before = torch.get_num_threads()
    with threads.handed_over() as count:
        assert count == (threads.chosen() or before)
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == count


def test_a_passing_thread_returns_its_result_and_raises_its_error_here():
    assert threads.in_passing_thread(lambda a, b: (a + b, threading.current_thread() is threading.main_thread()),
                                     2, 3) == (5, False)

    def refuse():
        raise UserError("no row fits")

    with pytest.raises(UserError, match="no row fits"):
        threads.in_passing_thread(refuse)


@pytest.mark.skipif(not torch.backends.openmp.is_available() or not os.path.isdir("/proc/self/task"),
                    reason="OpenMP pools are counted from Linux's /proc/self/task")
def test_a_passing_thread_leaves_no_openmp_workers_behind():
    """A thread that opens a two-thread parallel region starts a worker; once it ends, the worker is gone (a
    fresh process, so the count is not another test's)."""
    script = textwrap.dedent("""
        import os, threading, time, torch
        from h2ochat import threads
        def tasks():
            return len(os.listdir("/proc/self/task"))
        def parallel_region():
            torch.set_num_threads(2)
            torch.ones(1 << 22).add_(1)  # (aten splits it over the threads)
            return tasks()
        torch.set_num_threads(2)  # (torch's own thread pool for some ops starts here, not in the passing thread)
        before = tasks()
        inside = threads.in_passing_thread(parallel_region)
        for _ in range(500):  # the pool's worker exits once it sees its thread gone
            if tasks() == before:
                break
            time.sleep(0.01)
        print(before, inside, tasks())
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr
    before, inside, after = map(int, result.stdout.split())
    assert inside >= before + 2  # the passing thread and its pool's worker
    assert after == before


def test_serve_checks_the_kv_memory_off_its_main_thread_and_computes_with_one_thread_there(monkeypatch):
    seen = {}
    passing = threads.in_passing_thread

    def in_passing_thread(function, *args):
        seen["main_threads"] = torch.get_num_threads()  # (the main thread's own count, while serve runs)
        return passing(function, *args)

    def check(config):
        seen["in_main_thread"] = threading.current_thread() is threading.main_thread()
        raise UserError("stop here")

    outside = torch.get_num_threads()
    monkeypatch.setattr(threads, "in_passing_thread", in_passing_thread)
    monkeypatch.setattr(server, "check_kv_memory", check)
    with pytest.raises(UserError, match="stop here"):
        server.serve(server.ServeConfig(model="x", settings=None))
    assert seen == {"main_threads": 1, "in_main_thread": False}
    assert torch.get_num_threads() == outside  # put back once serve returns


def test_the_engine_thread_computes_with_the_threads_handed_over(monkeypatch):
    """The loader runs first thing in the engine's thread: it sets that thread's count before loading."""
    seen = {}

    def load(*args, **kwargs):
        seen["threads"] = torch.get_num_threads()
        raise UserError("stop here")

    monkeypatch.setattr(server, "load", load)
    wanted = 1 if torch.get_num_threads() > 1 else 2
    load_engine = server.loader(server.ServeConfig(model="x", settings=server.CacheSettings()), None, wanted)
    with pytest.raises(UserError, match="stop here"):
        threads.in_passing_thread(load_engine)
    assert seen == {"threads": wanted}
