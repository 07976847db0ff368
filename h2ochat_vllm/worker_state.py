"""What one worker process holds for one engine step, between the connector and the attention backend.

The connector's worker side stores the step's plan (for every scheduled request: the block that
identifies its row, and the logical blocks it has evicted) before the attention metadata is built;
the backend compacts each row by it and adds the block scores of every layer into the step's
accumulator; the connector sends the step's scores back and clears them. Every tensor-parallel rank
holds the same plan (the scheduler broadcasts it) and its own heads' scores, which vLLM sums across
ranks before the scheduler reads them, so the decisions are one and the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestPlan:
    marker_block: int  # physical id of the block holding the request's last token this step: its own
    evicted: tuple[int, ...]  # logical blocks no longer attended as themselves, ascending
    recall_slots: tuple[int, ...] = ()  # physical blocks the request's recalled blocks are copied into
    to_cold: tuple[tuple[int, int], ...] = ()  # (logical, physical) evicted this step and kept cold
    restarted: bool = False  # the request starts over (new, or preempted): forget its cold blocks


@dataclass(frozen=True)
class StepOptions:
    """The settings a worker applies each step, sent with every plan."""

    score_queries: int = 0  # 0: every query of the step adds its attention; k: the last k of each request
    score_every: int = 1  # k: a one-token step adds its attention only at a position multiple of k
    recall_queries: int = 32  # a prompt chunk's last queries: they choose its recalled blocks
    recall_rest: bool = True  # those queries also attend every cold block (``rest``)


@dataclass
class ScoredRow:
    req_id: str
    logical: torch.Tensor  # [k] the logical index of each block of the row, in row order; -1: a recall slot
    logical_blocks: int  # the request's blocks in the text, evicted ones counted


@dataclass
class StepState:
    plans: dict[str, RequestPlan] = field(default_factory=dict)
    options: StepOptions = field(default_factory=StepOptions)
    rows: list[ScoredRow | None] = field(default_factory=list)
    scores: torch.Tensor | None = None  # [rows, most kept blocks] float32, summed over the step's layers

    def set_plans(self, plans: dict[str, RequestPlan], options: StepOptions = StepOptions()) -> None:
        self.plans = plans
        self.options = options

    def scores_token_at(self, position: int) -> bool:
        """Whether a step that computes one token, at ``position``, adds its attention (``score_every``)."""
        every = self.options.score_every
        return every == 1 or position % every == 0

    def begin_step(self, rows: list[ScoredRow | None]) -> torch.Tensor:
        self.rows = rows
        width = max((row.logical.numel() for row in rows if row is not None), default=0)
        self.scores = torch.zeros(len(rows), width, dtype=torch.float32)
        return self.scores

    def take_scores(self) -> dict[str, torch.Tensor]:
        """req id -> [logical blocks] float32, the step's attention per block; clears the step."""
        taken = {}
        if self.scores is not None:
            for index, row in enumerate(self.rows):
                if row is not None:
                    # a recall slot's attention goes to no block: a recalled block stays cold, chosen anew each step
                    own = row.logical >= 0
                    got = self.scores[index, : row.logical.numel()][own]
                    taken[row.req_id] = torch.zeros(row.logical_blocks).index_add_(0, row.logical[own], got)
        self.rows, self.scores = [], None
        return taken


STATE = StepState()
