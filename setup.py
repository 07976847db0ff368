"""Builds the CPU kernels at install: every variant in h2ochat_kernels/cpu/variants.py, as an optional extension.

Everything else about the package is in pyproject.toml. A variant the compiler cannot build (no compiler: CC=false,
a compiler without those instruction sets, another architecture) is left out with a warning and the install goes
on: h2ochat then runs the torch route for what it would have done, with the same results, and says so once.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
CSRC = HERE / "h2ochat_kernels" / "cpu" / "csrc"
_spec = importlib.util.spec_from_file_location("h2ochat_variants", HERE / "h2ochat_kernels" / "cpu" / "variants.py")
variants = sys.modules["h2ochat_variants"] = importlib.util.module_from_spec(_spec)  # (registered: its dataclass asks)
_spec.loader.exec_module(variants)


class OptionalKernels(build_ext):
    """Each kernel built with OpenMP where it asks for it, then without (one thread), then left out."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as error:  # (CompileError, LinkError, a missing compiler: whatever the toolchain says)
            if "-fopenmp" in ext.extra_compile_args:
                ext.extra_compile_args = [f for f in ext.extra_compile_args if f != "-fopenmp"]
                ext.extra_link_args = [f for f in ext.extra_link_args if f != "-fopenmp"]
                return self.build_extension(ext)
            self.warn(f"h2ochat: the CPU kernel {ext.name} was not built ({str(error).splitlines()[0] if str(error) else type(error).__name__}); "
                      "its work runs on the torch route, slower, with the same results")


def extension(variant) -> Extension:
    openmp = ["-fopenmp"] if variant.openmp else []
    return Extension(variant.extension, sources=[str((CSRC / variant.source).relative_to(HERE))],
                     include_dirs=[str(CSRC.relative_to(HERE))], depends=[str(p.relative_to(HERE)) for p in CSRC.glob("*.h")],
                     extra_compile_args=[*variants.BASE_FLAGS, *variant.flags, *openmp], extra_link_args=openmp,
                     optional=True)


setup(ext_modules=[extension(v) for v in variants.VARIANTS], cmdclass={"build_ext": OptionalKernels})
