"""Host memory free now (psutil's "available": what can be allocated without swapping), read where the
engine decides whether frozen weights fit and where loading checks a model fits: one reading for both."""

from __future__ import annotations


def free_host_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available
