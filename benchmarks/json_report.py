"""A benchmark's JSON report in the results envelope, printed and, with ``--out``, written to that file.

Every ``benchmarks/results_*.json`` has the same outer shape, so that one script
(``tools/render_results.py``) can render the results page from them and a reader can tell what was
measured, how, on which code and on which machine:

    {"envelope": 1, "what": ..., "command": ..., "commit": ..., "date": ...,
     "machine": {"cpu", "cpu_flags", "physical_cores", "logical_cpus", "load_average", ...},
     "figures": {...the script's own report...}}

A field that was never recorded reads "unknown". A script run from benchmarks/ imports this module by
name (``from json_report import emit``); ``write`` serves a script that prints its own summary, and
``envelope`` and ``figures`` scripts that write or read the files themselves (merging into one).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

VERSION = 1
UNKNOWN = "unknown"
# the CPU features a figure here depends on: bf16 matmuls (AVX512-BF16, AMX), the C kernels' builds (AVX2, FMA)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
ROOT = Path(__file__).resolve().parents[1]


def _cpuinfo() -> tuple[str, list[str]]:
    """The CPU's model name and which of ``CPU_FLAGS`` it has (Linux; unknown elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or UNKNOWN, []
    name, flags = UNKNOWN, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == UNKNOWN:
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return name, [flag for flag in CPU_FLAGS if flag in flags]


def machine() -> dict:
    """What a figure measured here depends on: the CPU and its features, the cores, the load around it."""
    name, flags = _cpuinfo()
    info = {"cpu": name, "cpu_flags": flags, "logical_cpus": os.cpu_count() or UNKNOWN, "physical_cores": UNKNOWN,
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else UNKNOWN,
            "memory_bytes": UNKNOWN, "python": platform.python_version(), "torch": UNKNOWN}
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False) or UNKNOWN
        info["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    if "torch" in sys.modules:  # (a benchmark that ran torch has it; importing it here would cost seconds)
        info["torch"] = sys.modules["torch"].__version__
    return info


def commit() -> str:
    """The checked-out commit, with ``-dirty`` when tracked files differ from it; unknown outside git."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        if head.returncode:
            return UNKNOWN
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN


def _main_summary() -> str:
    """The first line of the running script's docstring: what it measures."""
    doc = getattr(sys.modules.get("__main__"), "__doc__", None) or ""
    return doc.strip().splitlines()[0] if doc.strip() else UNKNOWN


def envelope(figures: dict, *, what: str | None = None, command: str | None = None) -> dict:
    """``figures`` wrapped with what was measured (default: the script's summary), the command (default:
    this process's), the commit, the date and the machine."""
    return {"envelope": VERSION, "what": what or _main_summary(),
            "command": command or shlex.join(["python", *sys.argv]), "commit": commit(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": machine(),
            "figures": figures}


def is_envelope(report) -> bool:
    return isinstance(report, dict) and report.get("envelope") == VERSION and "figures" in report


def unwrap(report) -> dict:
    """The figures of a report (one written before the envelope: the whole of it)."""
    return report["figures"] if is_envelope(report) else report


def figures(path: str | Path) -> dict:
    """The figures of a results file (a file written before the envelope: its whole content)."""
    return unwrap(json.loads(Path(path).read_text()))


def write(report: dict, out: str | Path, *, what: str | None = None) -> dict:
    """Write ``report`` in its envelope to ``out`` (a report already in one as it is), printing nothing:
    for a script that prints its own summary. Returns what it wrote."""
    wrapped = report if is_envelope(report) else envelope(report, what=what)
    Path(out).write_text(json.dumps(wrapped, indent=1) + "\n")
    return wrapped


def emit(report: dict, out: str | Path | None, *, what: str | None = None) -> None:
    """Print ``report`` in its envelope and, with ``out``, write it there (a report already in one as it is)."""
    wrapped = write(report, out, what=what) if out else report if is_envelope(report) else envelope(report, what=what)
    print(json.dumps(wrapped, indent=1))


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/json_report.py FILE --what TEXT --command TEXT``: wrap a report written another way
    (``h2ochat eval --json > FILE``) in the envelope, in place, with this checkout's commit and machine."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("file", type=Path)
    parser.add_argument("--what", required=True, help="what was measured, in a sentence")
    parser.add_argument("--command", required=True, help="the command that wrote the file")
    args = parser.parse_args(argv)
    report = json.loads(args.file.read_text())
    if is_envelope(report):
        print(f"{args.file} is already in the envelope", file=sys.stderr)
        return 1
    args.file.write_text(json.dumps(envelope(report, what=args.what, command=args.command), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
