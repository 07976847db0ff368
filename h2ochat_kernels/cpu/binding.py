"""A built variant's entry points, typed by its ``csrc/<module>_api.h`` through cffi.

The header is the one list of the entry points' types: the C units include it (the compiler holds each
definition to it) and cffi reads it here, so a call with the wrong number or kind of arguments is a TypeError,
not a crash. Callers pass tensors' ``data_ptr()`` ints where the C side takes pointers (and None for NULL):
``Entry`` casts them by the declared types, once per argument. cffi lets the GIL go for the call.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import cffi

from .variants import Variant

CSRC = Path(__file__).with_name("csrc")


@functools.cache
def _ffi(module: str) -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef((CSRC / f"{module}_api.h").read_text())
    return ffi


def built(variant: Variant) -> Path | None:
    """The variant's shared library as the install built it, or None where it did not."""
    try:
        spec = importlib.util.find_spec(variant.extension)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


class Entry:
    """One entry point: call it with Python ints, floats, None and cffi arrays (``Library.array``)."""

    def __init__(self, ffi: cffi.FFI, function):
        self.function = function
        kinds = ffi.typeof(function).args
        # (index, type) of each pointer argument: an int there is an address, None is NULL
        self.pointers = tuple((i, kind) for i, kind in enumerate(kinds) if kind.kind == "pointer")
        self.cast, self.null = ffi.cast, ffi.NULL

    def __call__(self, *args):
        args = list(args)
        for i, kind in self.pointers:
            value = args[i]
            if value is None:
                args[i] = self.null
            elif isinstance(value, int):
                args[i] = self.cast(kind, value)
        return self.function(*args)


class Library:
    """A loaded variant: ``library.h2ochat_page_best(...)`` and the others of its header, as ``Entry``s."""

    def __init__(self, variant: Variant, path: Path):
        self.variant, self.ffi = variant, _ffi(variant.module)
        self._lib = self.ffi.dlopen(str(path))
        self._entries: dict[str, Entry] = {}

    def __getattr__(self, name: str) -> Entry:
        if name.startswith("_"):
            raise AttributeError(name)
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = Entry(self.ffi, getattr(self._lib, name))
        return entry

    def array(self, kind: str, items: list) -> object:
        """A C array of ``kind`` (a struct of the header, e.g. "strided_t") holding ``items`` (tuples)."""
        return self.ffi.new(f"{kind}[{len(items)}]", items)


@functools.cache
def load(variant: Variant) -> Library | None:
    path = built(variant)
    return None if path is None else Library(variant, path)
