"""One-off: wrap every benchmarks/results_*.json written before the envelope in it
(``benchmarks/json_report.py``), and remove the files a later run of the same measurement superseded.

What each field is taken from, in order; "unknown" where the file never recorded it:
- what: the file's own ``what`` or ``purpose``, else its name (``results_recall_cost_s63_avx2`` ->
  "recall cost, avx2");
- command: ``command``, ``commands`` or ``argv`` (``python`` prepended to a script's argv);
- commit and date: the file's own, else the commit that added the file and its date (``git log``);
- machine: the file's ``machine`` (a dict or a CPU name) and its load average where it kept one;
- figures: everything else, as it was.

Superseded: files named for the run that made them (``_s<N>``) form a family with the part of the name
around that suffix; where a family holds several runs, only the newest run's files stay (with their
``_before`` / ``_rerun`` companions, and the ``.jsonl`` trial logs beside them). A file a script, test or
module names stays whatever its age. git keeps what goes.

    python tools/migrate_results.py [--dry-run]
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from json_report import UNKNOWN, VERSION, is_envelope  # noqa: E402

RUN = re.compile(r"_s(\d+)(?=_|$)")
COMPANION = re.compile(r"_(before|rerun|third|b|c)$")
LIFTED = ("what", "purpose", "command", "commands", "argv", "commit", "date", "machine")


def _git(*args) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def added(path: Path) -> tuple[str, str]:
    """(commit, date) of the commit that added ``path``."""
    line = _git("log", "--diff-filter=A", "--follow", "--format=%h %cI", "--", str(path.relative_to(ROOT)))
    last = line.splitlines()[-1] if line else ""
    return tuple(last.split(" ", 1)) if last else (UNKNOWN, UNKNOWN)


def _command(report: dict) -> str | list[str]:
    if isinstance(report.get("command"), str):
        return report["command"]
    if report.get("commands"):
        commands = report["commands"]
        return commands if isinstance(commands, list) else str(commands)
    argv = report.get("argv")
    if isinstance(argv, list) and argv:
        return shlex.join(["python", *argv]) if str(argv[0]).endswith(".py") else shlex.join(argv)
    if isinstance(argv, str):
        return argv
    return UNKNOWN


def _machine(report: dict) -> dict:
    recorded = report.get("machine")
    info = {"cpu": UNKNOWN, "cpu_flags": UNKNOWN, "logical_cpus": UNKNOWN, "physical_cores": UNKNOWN,
            "load_average": UNKNOWN, "memory_bytes": UNKNOWN, "python": UNKNOWN, "torch": UNKNOWN}
    if isinstance(recorded, str):
        info["cpu"] = recorded
    elif isinstance(recorded, dict):
        info.update({key: value for key, value in recorded.items() if key in info})
        if "bf16_flags" in recorded:
            info["cpu_flags"] = recorded["bf16_flags"]
        if "load_average_before" in recorded:
            info["load_average"] = recorded["load_average_before"]
        info.update({key: value for key, value in recorded.items() if key not in info and key != "bf16_flags"})
    for key in ("load_average_before", "load_average"):
        if info["load_average"] == UNKNOWN and key in report:
            info["load_average"] = report[key]
    return info


def title(stem: str) -> str:
    """``results_recall_cost_s63_avx2`` -> "recall cost, avx2"."""
    name = stem.removeprefix("results_")
    head, _, tail = RUN.sub("|", name).partition("|")
    words = head.replace("_", " ").strip()
    tail = tail.strip("_").replace("_", " ")
    return f"{words}, {tail}" if tail else words


def wrapped(path: Path) -> dict:
    report = json.loads(path.read_text())
    commit, date = added(path)
    what = report.get("what") or report.get("purpose")
    return {"envelope": VERSION, "what": what if isinstance(what, str) else title(path.stem),
            "command": _command(report), "commit": str(report.get("commit") or commit),
            "date": str(report.get("date") or report.get("started") or date), "machine": _machine(report),
            "figures": {key: value for key, value in report.items() if key not in LIFTED}}


def cited() -> set[str]:
    """Results files named by a script, a test or the package (they stay)."""
    names = set()
    for folder in ("benchmarks", "tests", "h2ochat", "h2ochat_kernels"):
        for source in (ROOT / folder).rglob("*.py"):
            names.update(re.findall(r"results_[A-Za-z0-9_.-]+?\.json", source.read_text(errors="replace")))
    return names


def superseded(paths: list[Path]) -> list[Path]:
    families: dict[str, list[tuple[int, Path]]] = defaultdict(list)
    for path in paths:
        run = RUN.search(path.stem)
        family = COMPANION.sub("", RUN.sub("", path.stem))
        families[family].append((int(run.group(1)) if run else -1, path))
    keep_names = cited()
    gone = []
    for members in families.values():
        newest = max(run for run, _ in members)
        if newest < 0:
            continue  # no run numbers: nothing says which is newer
        gone += [path for run, path in members if run < newest and path.name not in keep_names]
    return sorted(gone)


def main(argv: list[str]) -> int:
    dry = "--dry-run" in argv
    paths = sorted(BENCHMARKS.glob("results_*.json"))
    gone = superseded(paths)
    for path in gone:
        for twin in (path, path.with_suffix(".jsonl")):
            if twin.exists():
                print(f"remove {twin.relative_to(ROOT)}")
                if not dry:
                    _git("rm", "-q", str(twin.relative_to(ROOT)))
    for path in paths:
        if path in gone or is_envelope(json.loads(path.read_text())):
            continue
        envelope = wrapped(path)
        if not dry:
            path.write_text(json.dumps(envelope, indent=1) + "\n")
    print(f"{len(paths) - len(gone)} results files in the envelope, {len(gone)} superseded removed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
