"""What one worker process holds for one engine step, between the connector and the attention backend.

The connector's worker side stores the step's plan (for every scheduled request: the block that
identifies its row, and the logical blocks it has evicted) before the attention metadata is built;
the backend compacts each row by it and adds the block scores it computes; the connector sends the
step's scores back and clears them. Every tensor-parallel rank holds the same plan (the scheduler
broadcasts it) and its own heads' scores, which vLLM sums across ranks before the scheduler reads
them, so the decisions are one and the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestPlan:
    marker_block: int  # physical id of the block holding the request's last token this step: its own
    evicted: tuple[int, ...]  # logical blocks no longer attended, ascending


@dataclass
class StepState:
    plans: dict[str, RequestPlan] = field(default_factory=dict)
    scores: dict[str, torch.Tensor] = field(default_factory=dict)  # req id -> [logical blocks] float32

    def set_plans(self, plans: dict[str, RequestPlan]) -> None:
        self.plans = plans

    def add_scores(self, req_id: str, logical: torch.Tensor, scores: torch.Tensor, length: int) -> None:
        total = self.scores.get(req_id)
        if total is None or total.numel() < length:
            grown = torch.zeros(length, dtype=torch.float32)
            if total is not None:
                grown[: total.numel()] = total
            total = self.scores[req_id] = grown
        total.index_add_(0, logical, scores)

    def take_scores(self) -> dict[str, torch.Tensor]:
        taken, self.scores = self.scores, {}
        return taken


STATE = StepState()
