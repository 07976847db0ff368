"""Whether this CPU computes bfloat16 matrix products natively, which decides ``--dtype auto`` on the CPU.

A CPU with AMX-BF16 tiles or AVX512-BF16 dot products runs SmolLM2's bf16 linears 1.65-2.2x faster
than fp32 at 8-300 rows (``benchmarks/results_peers_bf16_matmul.json``); one without them emulates
bf16 through fp32 and gains nothing but rounding. Linux's ``/proc/cpuinfo`` flags say which (read by
``h2ochat_kernels.dispatch.cpu_flags``, the kernels' dispatcher's reader too); elsewhere (no such file) the answer is no.
``H2OCHAT_NATIVE_BF16=1`` or ``0`` overrides the detection (a VM whose flags promise what it cannot run; the
test suite pins it to 0 so every machine gets fp32).
"""

from __future__ import annotations

import os

from h2ochat_kernels.dispatch import cpu_flags

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
OVERRIDE = "H2OCHAT_NATIVE_BF16"


def cpu_has_native_bf16() -> bool:
    override = os.environ.get(OVERRIDE, "").strip().lower()
    if override in ("0", "1", "true", "false", "yes", "no"):
        return override in ("1", "true", "yes")
    return bool(cpu_flags() & set(NATIVE_BF16_FLAGS))
