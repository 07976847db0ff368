"""Building this project's C kernels (``engine/row_kernel.c``, ``recall/recall_kernel.c``) on the user's
machine: once per machine, with the system's C compiler, into the user's cache folder, and binding their
functions through ctypes (which lets the GIL go while they run).

A kernel is built only where it can run: a C compiler is on PATH (or $CC), ``H2OCHAT_ROW_KERNEL`` is not
"0" (the one switch that turns every C kernel off; each kernel may have its own switch too), and for the
AVX512-BF16 builds (``FLAGS``: the row kernel's VDPBF16PS) the CPU has ``avx512_bf16``. The recall kernel
also builds portably elsewhere (``portable_flags``: AVX2 and FMA where the CPU has them). Each kernel's
module checks its first results against torch before using it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

ENVIRONMENT_SWITCH = "H2OCHAT_ROW_KERNEL"  # "0": no C kernel at all
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-shared", "-fPIC"]
BASE_FLAGS = ["-O3", "-shared", "-fPIC"]
THREADED = ["-fopenmp"]  # (a compiler without OpenMP, clang without libomp, builds it single-threaded)


@functools.lru_cache(maxsize=1)
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as Linux lists them for its first processor (x86 ``flags``, ARM ``Features``);
    empty where the file is unreadable (not Linux). The one reader: the kernels' builds ask it, and so does
    ``--dtype auto`` (``loading.native_bf16``)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


def portable_flags() -> list[str]:
    """A build for this CPU without AVX512-BF16: AVX2 and FMA where it has them, else the compiler's baseline."""
    return [*BASE_FLAGS, *(["-mavx2", "-mfma"] if {"avx2", "fma"} <= cpu_flags() else [])]


def cache_folder() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "h2ochat" / "native"


def compiler() -> str | None:
    """The C compiler's command line: $CC as the shell would split it ("ccache gcc"), else cc or gcc."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(command: str, path: Path, base: list[str] = FLAGS) -> Path:
    """The shared library for the C file ``path`` built by ``command`` with ``base`` flags, compiled unless the
    cache already has it (written under a temporary name and renamed, so two processes building at once
    both load a whole file): with OpenMP, else without. Raises OSError where it does not build."""
    failure, source = "no output", path.read_bytes()
    for flags in ([*base, *THREADED], base):
        digest = hashlib.sha256(source + " ".join([command, *flags]).encode()).hexdigest()[:16]
        library = cache_folder() / f"{path.stem}-{digest}.so"
        if library.is_file():
            return library
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as work:
            partial = Path(work) / library.name
            result = subprocess.run([*shlex.split(command), *flags, str(path), "-o", str(partial)],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode == 0:
                os.replace(partial, library)
                return library
            lines = (result.stderr or result.stdout).strip().splitlines()
            failure = lines[0] if lines else "no output"
    raise OSError(f"{command} failed: {failure}")


def why_not_here(avx512_bf16: bool = True) -> str:
    """Why no C kernel is built on this machine ("" where they are): the switch, the CPU (``avx512_bf16``:
    for an AVX512-BF16 build), the compiler."""
    if os.environ.get(ENVIRONMENT_SWITCH, "1") == "0":
        return f"{ENVIRONMENT_SWITCH}=0"
    if avx512_bf16 and not cpu_has_avx512_bf16():
        return "the CPU has no avx512_bf16"
    if compiler() is None:
        return "no C compiler (cc or gcc) on PATH"
    return ""


def checked(what: str, path: Path, command: str, bind, agrees, flags: list[str] = FLAGS) -> tuple[object | None, str]:
    """Build ``path`` with ``command`` and ``flags``, ``bind`` its library and check the result with ``agrees`` (its
    first results against torch's): (what ``bind`` returned, "") or (None, why it is not used, one line)."""
    try:
        kernel = bind(build(command, path, flags))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        return None, f"the {what} did not build: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    if not agrees(kernel):
        return None, f"the {what}'s first results disagreed with torch's"
    return kernel, ""


def signed(library: Path, name: str, argtypes: list, returns=None):
    """The C function ``name`` of ``library`` with these argument types, returning ``returns`` (a ctypes
    type; None: nothing)."""
    function = getattr(ctypes.CDLL(str(library)), name)
    function.argtypes = argtypes
    function.restype = returns
    return function
