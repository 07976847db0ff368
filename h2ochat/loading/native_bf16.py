"""Whether this CPU computes bfloat16 matrix products natively, which decides ``--dtype auto`` on the CPU.

A CPU with AMX-BF16 tiles or AVX512-BF16 dot products runs SmolLM2's bf16 linears 1.65-2.2x faster
than fp32 at 8-300 rows (``benchmarks/results_peers_bf16_matmul.json``); one without them emulates
bf16 through fp32 and gains nothing but rounding. Linux's ``/proc/cpuinfo`` flags say which; elsewhere
(no such file) the answer is no. ``H2OCHAT_NATIVE_BF16=1`` or ``0`` overrides the detection (a VM whose
flags promise what it cannot run; the test suite pins it to 0 so every machine gets fp32).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
OVERRIDE = "H2OCHAT_NATIVE_BF16"


def cpu_has_native_bf16() -> bool:
    override = os.environ.get(OVERRIDE, "").strip().lower()
    if override in ("0", "1", "true", "false", "yes", "no"):
        return override in ("1", "true", "yes")
    return bool(_cpuinfo_flags() & set(NATIVE_BF16_FLAGS))


@functools.lru_cache(maxsize=1)
def _cpuinfo_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's feature flags (x86 ``flags``, ARM ``Features``); empty when unreadable."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()
