"""A resumable log of scored samples: one JSON line per finished sample, appended as it finishes.

A long table (hours on a 2-core CPU) must survive an interruption and grow across runs: a run given
the same log reads the samples already there, skips them, and appends the rest. A line cut short by
an interruption is ignored (its sample runs again). The key of a sample is (row, task, length,
sample id, digest): the same cache row on the same built sample, the digest a fingerprint of what was
built (``fingerprint``), so a record of another prompt under the same id (another seed, another
builder version) is run again rather than counted."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Iterable

KEY_FIELDS = ("row", "task", "length", "sample", "digest")


def fingerprint(sample) -> str:
    """12 hex digits of what was built (its repr: a frozen dataclass's prompt, answers and sizes, and
    whatever else is passed with it, such as the model and its dtype)."""
    return hashlib.sha1(repr(sample).encode("utf-8")).hexdigest()[:12]


def sample_key(record: dict) -> tuple:
    return tuple(record[name] for name in KEY_FIELDS)


class EvalLog:
    """Finished samples of ``path`` (read at start) and an append-only writer for new ones."""

    def __init__(self, path: Path | str | None):
        self.path = Path(path) if path is not None else None
        self.records: dict[tuple, dict] = {}
        if self.path is None:
            return
        if self.path.is_dir():
            raise ValueError(f"--output {self.path} is a directory, not a file")
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                    self.records[sample_key(record)] = record
                except (ValueError, KeyError, TypeError):  # a line cut short by an interruption
                    continue
        try:  # unwritable: say so before the model loads, not after the first sample
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as out:
                if self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
                    out.write("\n")  # end a line cut short, or the next record would join it
        except OSError as exc:
            raise ValueError(f"cannot write --output {self.path}: {exc.strerror or exc}") from None

    def done(self, key: tuple) -> bool:
        return key in self.records

    def add(self, record: dict) -> None:
        self.records[sample_key(record)] = record
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as out:  # one line, flushed: a kill loses at most it
                out.write(json.dumps(record) + "\n")

    def matching(self, keys: Iterable[tuple]) -> list[dict]:
        """The records of ``keys`` that are done, in that order."""
        return [self.records[key] for key in keys if key in self.records]


class Eta:
    """Samples done and the time left, from the mean seconds of the samples run in this process."""

    def __init__(self, total: int, already: int):
        self.total, self.done, self.started, self.ran = total, already, time.perf_counter(), 0

    def step(self) -> str:
        self.done += 1
        self.ran += 1
        per = (time.perf_counter() - self.started) / self.ran
        left = per * (self.total - self.done)
        return f"{self.done}/{self.total} samples, ~{left / 60:.0f} min left"
