"""How many CPU threads torch computes with: --threads, else OMP_NUM_THREADS, else a measured rule.

The rule: the physical cores this process may run on, less the ones other jobs keep busy (the
one-minute load average), at least one. Measured with SmolLM2-135M on a 2-core machine
(results_bench_smollm2_4096_b4_2threads.json, docs/results.md): a second OpenMP thread that another job keeps
off its core stalls every matmul (decode several times slower), while on an idle machine a second thread
costs decode nothing worth having and speeds prompt reading up. So a busy core is never counted, an idle one
always is. torch's own default is every logical CPU.

Applied before torch is imported where possible (OMP_NUM_THREADS, which also reaches threads
started later, such as the server's engine), and through torch.set_num_threads.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

_chosen: int | None = None  # what apply() set, for --json records and the status line


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or usable_cpus()
    except ImportError:  # pragma: no cover
        return usable_cpus()


def busy_cpus() -> int:
    """CPUs other jobs keep busy: the one-minute load average, rounded (0 where there is none)."""
    try:
        return int(os.getloadavg()[0] + 0.5)
    except (AttributeError, OSError):
        return 0


def default_threads() -> int:
    cpus = usable_cpus()
    return max(1, min(physical_cores(), cpus) - busy_cpus())


def check_count(count: int, source: str = "--threads") -> int:
    """``count`` if this process may run that many threads each on its own CPU; ValueError in one line
    otherwise: more threads than CPUs only take turns on them, and thousands stall the machine."""
    cpus = usable_cpus()
    if count > cpus:
        raise ValueError(f"{source} {count} is more than the {cpus} CPU{'s' if cpus != 1 else ''} this process may "
                         f"run on: give at most {cpus}")
    return count


def requested_from_environment() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return check_count(int(value), "OMP_NUM_THREADS") if value.isdigit() and int(value) > 0 else None


def apply(requested: int | None) -> int:
    """Set the thread count (``requested``, else OMP_NUM_THREADS, else ``default_threads``) and
    return it. ValueError for a count above the CPUs this process may run on (``check_count``)."""
    global _chosen
    count = (check_count(requested) if requested else None) or requested_from_environment() or default_threads()
    if "torch" not in sys.modules:  # read by OpenMP when torch loads, for every thread it starts
        os.environ["OMP_NUM_THREADS"] = str(count)
    import torch

    torch.set_num_threads(count)
    _chosen = count
    return count


@contextmanager
def handed_over():
    """For a process whose compute runs in one other thread (the server's engine): yields the thread count
    that thread should take (``use``); the calling thread computes with one thread until the block ends.

    Why: OpenMP (libgomp, torch's) gives every thread that opens a parallel region a pool of workers of its
    own, and once all pools' threads outnumber the CPUs, a worker stops spinning between regions and sleeps
    at once: every region (hundreds per decode step) then waits for a futex wake. A server whose main thread
    had opened one region (its KV check) before the engine thread opened its own decoded a lone chat at
    two threads in about twice the time it took at one."""
    import torch

    count = _chosen or torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield count
    finally:
        torch.set_num_threads(count)


def in_passing_thread(function, *args):
    """``function(*args)`` in a thread that ends with it: its result, or its exception raised here. Work a
    process does before its compute thread starts (the server's KV check, which loads the kernels and checks
    them on two threads) leaves no OpenMP pool behind: a thread's pool ends with the thread (``handed_over``)."""
    import threading

    outcome = {}

    def run():
        try:
            outcome["value"] = function(*args)
        except BaseException as error:  # noqa: BLE001  raised again in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="h2ochat-passing", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def use(count: int) -> None:
    """Compute with ``count`` threads in the calling thread (OpenMP's count is each thread's own)."""
    import torch

    torch.set_num_threads(count)


def chosen() -> int | None:
    """The count ``apply`` set (None before: a library caller's torch default stands)."""
    return _chosen


def current() -> int:
    """The threads torch computes with now (what --json records report)."""
    import torch

    return torch.get_num_threads()
