"""Every compiled CPU kernel module and its instruction-set variants: the one registry that ``setup.py`` builds
from at install and ``h2ochat_kernels.dispatch`` chooses from at load. Standard library only: the build imports
this file by path, before torch or this package exist.

A variant is one C unit (under ``csrc/``) built with its flags into the extension ``h2ochat_kernels.cpu._<module>_
<variant>``. Every variant is built on every machine whose compiler takes its flags, whatever the building CPU,
so a machine runs the best one its CPU supports and the test suite can run the others it supports too. A new
kernel module is its C unit, its ``<module>_api.h`` of entry points (what cffi binds) and one line here.
"""

from __future__ import annotations

from dataclasses import dataclass

AVX512_BF16 = ("-mavx512f", "-mavx512bw", "-mavx512bf16")


@dataclass(frozen=True)
class Variant:
    module: str  # the kernel module: its entry points are csrc/<module>_api.h
    name: str  # the instruction set, as dispatch and H2OCHAT_CPU_KERNELS name it
    source: str  # the C unit under csrc/
    flags: tuple[str, ...]  # besides -O3: what the compiler needs for the instruction set
    cpu_needs: frozenset[str]  # the /proc/cpuinfo flags a CPU must list to run it
    openmp: bool = False  # threads by OpenMP (built without it, one thread, where the compiler has none)
    in_auto: bool = True  # False: run only when named (no faster than the torch route where it is the best)

    @property
    def extension(self) -> str:
        return f"h2ochat_kernels.cpu._{self.module}_{self.name}"


# best first within a module: dispatch takes the first one the CPU supports and the install built
VARIANTS = (
    Variant("recall", "avx512bf16", "recall_avx512bf16.c", AVX512_BF16,
            frozenset({"avx512f", "avx512bw", "avx512_bf16"})),
    Variant("recall", "avx2", "recall_portable.c", ("-mavx2", "-mfma"), frozenset({"avx2", "fma"})),
    Variant("recall", "generic", "recall_portable.c", (), frozenset()),
    Variant("rows", "avx512bf16", "rows_avx512bf16.c", AVX512_BF16,
            frozenset({"avx512f", "avx512bw", "avx512_bf16"}), openmp=True),
    Variant("attention", "avx512bf16", "attention_avx512bf16.c", AVX512_BF16,
            frozenset({"avx512f", "avx512bw", "avx512_bf16"}), openmp=True),
    Variant("attention", "avx2", "attention_portable.c", ("-mavx2", "-mfma"), frozenset({"avx2", "fma"}), openmp=True),
    # (without AVX2, no faster than the torch route: benchmarks/results_cpu_attention.json)
    Variant("attention", "generic", "attention_portable.c", (), frozenset(), openmp=True, in_auto=False),
    # the attention a decode step's queries give each kept block, read in place from vLLM's CPU key cache
    Variant("block_scores", "avx512bf16", "block_scores_avx512bf16.c", AVX512_BF16,
            frozenset({"avx512f", "avx512bw", "avx512_bf16"}), openmp=True),
    Variant("block_scores", "avx2", "block_scores_portable.c", ("-mavx2", "-mfma"), frozenset({"avx2", "fma"}),
            openmp=True),
    Variant("block_scores", "generic", "block_scores_portable.c", (), frozenset(), openmp=True),
)

MODULES = tuple(dict.fromkeys(v.module for v in VARIANTS))
ROUTES = tuple(dict.fromkeys(v.name for v in VARIANTS))  # every instruction set a module may be built for
BASE_FLAGS = ("-O3",)


def of(module: str) -> tuple[Variant, ...]:
    return tuple(v for v in VARIANTS if v.module == module)
