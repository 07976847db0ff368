"""A benchmark's JSON report, printed and, with ``--out``, written to that file: the one ending the
scripts that report this way share (a script run from benchmarks/ imports it by name)."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, out: str | Path | None) -> None:
    text = json.dumps(report, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
