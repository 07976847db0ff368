"""No lab journal in the package, the docs or the README: comments, docstrings and pages say what the
code does and why; figures live in the results files (benchmarks/results_*.json, docs/results.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = ("h2ochat", "h2ochat_kernels", "docs", "README.md")
TEXT_SUFFIXES = {".py", ".c", ".h", ".md", ".txt", ".json", ".toml", ".cfg", ".yaml", ".yml", ".rst"}
# "session 63", "Issue #34", "sessions 51-53": a journal entry's reference, not a description
JOURNAL = re.compile(r"\b(session|issue)s?\s*#?\d+", re.IGNORECASE)


def searched_files():
    for name in SEARCHED:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES
                        and "__pycache__" not in p.parts)


def test_no_session_or_issue_numbers():
    hits = []
    for path in searched_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if JOURNAL.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not hits, "journal references (say what and why; numbers go to the results page):\n" + "\n".join(hits)


def test_the_pattern_catches_what_it_should():
    assert JOURNAL.search("measured in Session 63")
    assert JOURNAL.search("see issue #34")
    assert JOURNAL.search("sessions 51")
    assert not JOURNAL.search("a chat session keeps its history")
    assert not JOURNAL.search("the issue is the page size")
