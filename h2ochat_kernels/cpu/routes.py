"""Which compiled variant of each CPU kernel module runs here: the CPU half of the one dispatcher
(``h2ochat_kernels.dispatch`` re-exports all of it; callers ask there). A module below the dispatcher, so the
kernel modules it routes to can ask it too without an import circle.

``H2OCHAT_CPU_KERNELS`` (read when a route is asked for): ``auto`` (default), the best variant of the module that
this CPU runs and the install built; a variant's name (``avx512bf16``, ``avx2``, ``generic``), that one, or none
where the CPU or the install lacks it; ``none``, no compiled CPU kernel.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from . import binding, variants

CPU_SWITCH = "H2OCHAT_CPU_KERNELS"
CPU_CHOICES = ("auto", "none", *variants.ROUTES)


@functools.lru_cache(maxsize=1)
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as Linux lists them for its first processor (x86 ``flags``, ARM ``Features``);
    empty where the file is unreadable (not Linux): then only the generic variants run."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_runs(variant: variants.Variant) -> bool:
    return variant.cpu_needs <= cpu_flags()


def why_not(variant: variants.Variant) -> str:
    """Why ``variant`` cannot run here ("" where it can): the CPU lacks its instruction set, or the install did not
    build it."""
    if not cpu_runs(variant):
        return f"the CPU lacks {', '.join(sorted(variant.cpu_needs - cpu_flags()))}"
    if binding.built(variant) is None:
        return "not built at install"
    return ""


def cpu_wanted() -> str:
    wanted = os.environ.get(CPU_SWITCH, "auto").strip().lower() or "auto"
    if wanted not in CPU_CHOICES:
        raise ValueError(f"{CPU_SWITCH}={wanted!r}: expected one of {', '.join(CPU_CHOICES)}")
    return wanted


def cpu_route(module: str) -> tuple[variants.Variant | None, str]:
    """The variant of ``module`` that runs here (``H2OCHAT_CPU_KERNELS``), or (None, why none does)."""
    return _cpu_route(module, cpu_wanted())


@functools.cache
def _cpu_route(module: str, wanted: str) -> tuple[variants.Variant | None, str]:
    if wanted == "none":
        return None, f"{CPU_SWITCH}=none"
    candidates = [v for v in variants.of(module) if wanted == v.name or (wanted == "auto" and v.in_auto)]
    if not candidates:
        return None, f"the {module} kernels have no {wanted} variant"
    reasons = []
    for variant in candidates:
        reason = why_not(variant)
        if not reason:
            return variant, ""
        reasons.append(f"{variant.name}: {reason}")
    why = "; ".join(reasons)
    if wanted == "auto" and any(cpu_runs(v) for v in candidates):
        _say_once(f"h2ochat: the {module} kernels were not built at install ({why}; a C compiler builds them), so "
                  "their work runs on the torch route: the same results, slower")
    return None, why


def cpu_checked(module: str, prepare, variant: variants.Variant | None = None) -> tuple[object | None, str]:
    """The route's kernels as ``prepare(library)`` makes them ready for use, having checked their first results
    against torch (None: they disagreed, and are never used), once per variant; or (None, why none runs).
    ``variant``: that one instead of ``cpu_route``'s (a benchmark timing every variant)."""
    why = ""
    if variant is None:
        variant, why = cpu_route(module)
    if variant is None:
        return None, why
    key = (variant, prepare)
    if key not in _prepared:
        library = binding.load(variant)
        if library is None:
            _prepared[key] = None, f"the {module} kernels' {variant.name} variant was not built"
        else:
            ready = prepare(library)
            _prepared[key] = (ready, "") if ready is not None else (
                None, f"the {module} kernels' {variant.name} variant disagreed with torch on its first results")
    return _prepared[key]


_prepared: dict[tuple, tuple[object | None, str]] = {}


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        print(message, file=sys.stderr)
