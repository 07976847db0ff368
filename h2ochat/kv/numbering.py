"""How a step's new tokens are numbered: their token indices and positions (``StepNumbers``), the
step's mode handed to the layers (``StepContext``), and the re-numbering
of held tokens when the next ones would pass the model's position limit (``Renumbering``). The cache
(``kv.cache.H2OCache``) owns the per-row counters and hands these out; every layer and tier records
exactly what it is handed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PositionLimitError(RuntimeError):
    """The next tokens would need positions the model was not trained for."""



@dataclass
class StepNumbers:
    """What one step's new tokens are, handed out once per step by the cache and recorded as is by
    every layer: token index and position [B, Q] (-1 for padding), and the position ids the model
    encodes them at (padding borrows its neighbour's)."""

    token_index: torch.Tensor
    positions: torch.Tensor
    position_ids: torch.Tensor
    # [B] bool for a decode step some rows sit out (None: every row takes part): a row left out writes
    # nothing anywhere and its counters stand still; its token index and position are -1
    active: torch.Tensor | None = None


@dataclass(frozen=True)
class StepContext:
    """What a layer needs of its cache during one step, built by the cache once per step (and again
    when the step's mode changes) and handed down with the call (``H2OCache.attend``): the layer and
    its tier read nothing of the cache's while a step runs.

    ``compiled``: inside ``H2OCache.compiled_decode`` (the host counters are left to its exit and
    nothing per-step may be read as a Python value). ``static_shapes``: decode steps attend over
    every slot column and evict in place. ``tokens_fed`` [B]: the per-row counts, this step's tokens
    counted (``newest`` is each row's newest token index)."""

    numbers: StepNumbers
    compiled: bool
    static_shapes: bool
    rotary: object | None  # ``h2ochat.rotary.Rotary`` (None: a model without RoPE)
    tokens_fed: torch.Tensor
    kind: object  # kv.full's cache kind (bounded, or growing), as the cache steps now

    @property
    def newest(self) -> torch.Tensor:
        return self.tokens_fed - 1


@dataclass
class Renumbering:
    """A re-numbering of positions as a function of (row, old position), the same for every layer and
    head: a row's distinct held positions, sorted, are numbered by rank (gaps closed); when there are
    more than ``span``, the newest span // 2 keep consecutive numbers and the older ones are squeezed
    into the rest in proportion. A position that was not among the held ones (a token held elsewhere,
    e.g. in a cold tier) takes the number of the first held position after it.

    Only the rows in ``rows`` move (None: every row): each row is re-numbered when its own next tokens
    would pass the limit, so a row's positions, and so its keys and tokens, never depend on how long
    the rows beside it are (a server's chats, a story's continuations); the others keep theirs exactly."""

    distinct: torch.Tensor  # sorted keys row * stride + position over every row's held positions
    first: torch.Tensor  # [B + 1] where each row's keys start in ``distinct``
    stride: int
    span: int
    rows: torch.Tensor | None = None  # [B] bool: the rows that move (None: all)

    @classmethod
    def of(cls, batch: int, held: list[tuple[torch.Tensor, torch.Tensor]], span: int,
           rows: torch.Tensor | None = None) -> "Renumbering":
        """From ``held`` (positions [B, ...], valid [B, ...]) pairs: every layer's slots."""
        device = held[0][0].device
        stride = int(max(int(positions.max()) for positions, _ in held)) + 1
        keys = []
        for positions, valid in held:
            row_base = torch.arange(batch, device=device).view(-1, *([1] * (positions.dim() - 1))) * stride
            keys.append((positions + row_base)[valid])
        distinct = torch.unique(torch.cat(keys))  # sorted
        first = torch.searchsorted(distinct, torch.arange(batch + 1, device=device) * stride)
        return cls(distinct, first, stride, span, rows)

    def widened(self, batch: int) -> "Renumbering":
        """This re-numbering of a cache's first rows (a prefix cache's, ``H2OCache.prefix``) as one of
        ``batch`` rows in which the rows after them do not move (a tier shared with the whole cache)."""
        rows = self.first.shape[0] - 1
        if rows == batch:
            return self
        first = torch.cat([self.first, self.first[-1:].expand(batch - rows)])
        moving = self.rows if self.rows is not None else torch.ones(rows, dtype=torch.bool, device=first.device)
        moving = torch.cat([moving, torch.zeros(batch - rows, dtype=torch.bool, device=moving.device)])
        return Renumbering(self.distinct, first, self.stride, self.span, moving)

    def _row_shape(self, like: torch.Tensor) -> tuple[int, ...]:
        return (-1, *([1] * (like.dim() - 1)))

    def _widths(self, like: torch.Tensor):
        count = (self.first[1:] - self.first[:-1]).view(self._row_shape(like))  # distinct positions per row
        width = count.clamp(max=self.span)
        return count, width, width // 2

    def apply(self, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """New positions for ``positions`` [B, ...] (-1 where not ``valid``), on the positions' device.
        Old positions past the row's last held one keep their order after it (stride keeps rows apart)."""
        device = positions.device
        distinct, first = self.distinct.to(device), self.first.to(device)
        row_base = torch.arange(positions.shape[0], device=device).view(self._row_shape(positions)) * self.stride
        old = positions.clamp(min=0).clamp(max=self.stride - 1) + row_base
        rank = torch.searchsorted(distinct, old.contiguous()) - first[:-1].view(self._row_shape(positions))
        count, width, newest = (t.to(device) for t in self._widths(positions))
        rank = rank.clamp(max=(count - 1).clamp(min=0))
        squeezed = rank * (width - newest) // (count - newest).clamp(min=1)
        new_positions = torch.where(rank >= count - newest, rank - (count - width), squeezed)
        return self._moving(new_positions.masked_fill(~valid, -1), positions)

    def next_position(self, now: torch.Tensor) -> torch.Tensor:
        """[B]: the position each row's next token gets (one past its newest held token; ``now``, the
        rows' next positions before, for the rows that do not move)."""
        count = self.first[1:] - self.first[:-1]
        return self._moving(count.clamp(max=self.span).to(now.device), now)

    def _moving(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """``new`` for the rows that move, ``old`` (bit for bit) for the others."""
        if self.rows is None:
            return new
        return torch.where(self.rows.to(new.device).view(self._row_shape(new)), new, old)

