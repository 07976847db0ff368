"""Each batch row's own recall clock: host counts of the decode steps since the row's last
flush of its staging page, so a row flushes its page, and chooses its pages every ``every`` steps,
on its own count. A server's row then recalls as the same conversation alone would, whenever the
other rows joined; a row left out of a step (``StepNumbers.active``: a free row of a server; or a row past a
prefix cache's, ``H2OCache.prefix``) does not count it.

Host values only (the step's ``active`` mask is read once per step, a list of B booleans): the
decisions are taken before a step, as the tier's batch-wide counter was.
"""

from __future__ import annotations

import torch


class RowCadence:
    def __init__(self, batch: int, page: int, every: int):
        self.steps = [0] * batch  # decode steps since the row's last flush (>= the tokens it staged)
        self.page, self.every = page, every
        self._mask_of: torch.Tensor | None = None  # the last step's ``active`` tensor, and its host list
        self._mask: list[bool] | None = None
        self._rows = len(self.steps)  # (and the rows that step ran)

    def active(self, mask: torch.Tensor | None, rows: int | None = None) -> list[bool] | None:
        """The step's active rows as host booleans, one per row (None: every row), read once per step.
        ``rows``: how many leading rows the step runs (a prefix cache's, ``H2OCache.prefix``; None: all),
        ``mask`` [rows] bool among them: the rows after them sit the step out."""
        batch = len(self.steps)
        rows = batch if rows is None else rows
        if mask is None and rows == batch:
            return None
        if mask is not self._mask_of or rows != self._rows:
            leading = [True] * rows if mask is None else [bool(value) for value in mask.tolist()]
            self._mask_of, self._rows, self._mask = mask, rows, leading + [False] * (batch - rows)
        return self._mask

    def full(self) -> list[int]:
        """Rows whose next decode step could write past their staging page: flushed before it."""
        return [row for row, steps in enumerate(self.steps) if steps >= self.page]

    def staged(self) -> list[int]:
        """Rows that may hold staged tokens (a chunk flushes them first)."""
        return [row for row, steps in enumerate(self.steps) if steps]

    def choosing(self, active: list[bool] | None) -> bool | list[bool]:
        """The rows whose cadence is due this decode step (counted from their own flush), among the
        active ones: True for every row, False for none, else one boolean per row."""
        due = [(steps % self.every == 0) and (active is None or active[row]) for row, steps in enumerate(self.steps)]
        return True if all(due) else (any(due) and due)

    def count_step(self, active: list[bool] | None) -> None:
        for row in range(len(self.steps)):
            if active is None or active[row]:
                self.steps[row] += 1

    def moved(self, source: int, target: int) -> None:
        """Row ``source``'s conversation went on in row ``target`` (``H2OCache.move_row``): its count with it."""
        self.steps[target] = self.steps[source]

    def flushed(self, rows) -> None:
        for row in rows:
            self.steps[row] = 0
