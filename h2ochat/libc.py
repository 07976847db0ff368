"""The C library's memory calls the caches use (Linux): ``madvise`` to give a buffer's pages back, ``mincore`` to
count the pages a buffer has in memory, ``malloc_trim`` to return freed heap. Bound through cffi by their C
declarations; None where this system's C library lacks them (not glibc, not Linux)."""

from __future__ import annotations

import functools

import cffi

_DECLARATIONS = """
int madvise(void *addr, size_t length, int advice);
int mincore(void *addr, size_t length, unsigned char *vec);
int malloc_trim(size_t pad);
"""


@functools.cache
def _bound() -> tuple[cffi.FFI, object] | None:
    ffi = cffi.FFI()
    ffi.cdef(_DECLARATIONS)
    try:
        return ffi, ffi.dlopen(None)
    except OSError:
        return None


def _call(name: str, *args) -> int | None:
    bound = _bound()
    if bound is None:
        return None
    try:
        return getattr(bound[1], name)(*args)
    except AttributeError:  # (a C library without it)
        return None


def madvise(address: int, length: int, advice: int) -> bool:
    """Whether ``madvise`` took the advice for ``length`` bytes from ``address`` (page-aligned)."""
    bound = _bound()
    return bound is not None and _call("madvise", bound[0].cast("void *", address), length, advice) == 0


def resident_pages(address: int, pages: int, page_size: int) -> int:
    """How many of ``pages`` pages from ``address`` (page-aligned) are in memory (``mincore``)."""
    bound = _bound()
    if bound is None:
        raise OSError("mincore: no C library")
    flags = bound[0].new("unsigned char[]", pages)
    if _call("mincore", bound[0].cast("void *", address), pages * page_size, flags) != 0:
        raise OSError(bound[0].errno, "mincore")
    return sum(flag & 1 for flag in flags)


def malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: freed heap pages back to the system (nothing elsewhere)."""
    _call("malloc_trim", 0)
