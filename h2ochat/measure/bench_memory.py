"""Peak memory of one benchmark measurement.

Peak memory is the peak resident set size during that one measurement on a CPU (the kernel's
high-water mark, reset before each one through /proc/self/clear_refs; weights and everything else
the process holds included), or the peak CUDA memory allocated on a GPU; ``peak_memory_growth_bytes``
(``PeakMemory.growth``) is how far it rose during the measurement. Measurements run one after another in this process (a
forked child would be cleaner, but forking after PyTorch's OpenMP pool has run hangs the child).
"""

from __future__ import annotations

import re
import sys

import torch

from .. import libc


class PeakMemory:
    """Peak memory of one measurement: CUDA peak allocated, or the process's resident-set
    high-water mark reset before the measurement (Linux); the process-lifetime peak otherwise."""

    def __init__(self, device: torch.device):
        self.device = device
        self.scope = "cuda_allocated" if device.type == "cuda" else "process_rss"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        _return_freed_memory()
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # resets VmHWM to the current RSS
        except OSError:
            self.scope = "process_rss_lifetime"
        self.baseline = self._status("VmRSS")

    def peak(self) -> int:
        """Peak bytes since ``reset``, everything the process holds included (weights too)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        peak = self._status("VmHWM")
        if peak is None:
            from ..chat.report import peak_memory_bytes

            return peak_memory_bytes(self.device)
        return peak

    def growth(self) -> int | None:
        """How far the peak rose above what was held at ``reset`` (the measurement's own memory)."""
        baseline = getattr(self, "baseline", None)
        return None if baseline is None else max(0, self.peak() - baseline)

    def _status(self, field_name: str) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        try:
            with open("/proc/self/status") as handle:
                return int(re.search(field_name + r":\s+(\d+)", handle.read()).group(1)) * 1024
        except (OSError, AttributeError):
            return None


def _return_freed_memory() -> None:
    """glibc keeps freed blocks below its (moving) mmap threshold in the heap, so RSS would carry one
    measurement's tensors into the next one's peak: ``malloc_trim`` gives the freed pages back before each
    measurement. (Fixing the threshold at 256 KiB for the whole process, as this did before, made every
    larger temporary of a step a fresh mapping whose pages fault in again at every step: the steps it timed
    were ~20% slower at one row, and int8 slots at 8 rows 3.5x slower, than the same cache runs in
    ``generate`` or ``serve``.)"""
    if not sys.platform.startswith("linux"):
        return
    libc.malloc_trim()
