"""The attention backend's row compaction (imports vLLM, starts nothing)."""

from __future__ import annotations

import torch

from h2ochat_vllm.backend import compact
from h2ochat_vllm.worker_state import RequestPlan


def test_evicted_blocks_leave_the_row_and_the_length():
    table = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 0, 0], [30, 31, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([4 * 32 + 5, 3 * 32, 40], dtype=torch.int32)
    plans = {"a": RequestPlan(14, (1, 3)), "b": RequestPlan(22, ()), "other": RequestPlan(99, (0,))}
    got_table, got_lens, rows = compact(table, lens, 32, plans)
    assert got_table[0, :3].tolist() == [10, 12, 14] and got_lens[0] == 2 * 32 + 5
    assert got_table[1].tolist() == [20, 21, 22, 0, 0] and got_lens[1] == 96
    assert got_lens[2] == 40 and rows[2] is None  # a row with no plan is left alone
    assert rows[0].req_id == "a" and rows[0].logical.tolist() == [0, 2, 4] and rows[0].logical_blocks == 5
    assert table[0].tolist() == [10, 11, 12, 13, 14]  # the runner's table is not written


def test_recall_slots_come_first_and_count_in_the_length():
    table = torch.tensor([[10, 11, 12, 13, 14, 15]], dtype=torch.int32)
    lens = torch.tensor([5 * 32 + 7], dtype=torch.int32)
    plans = {"a": RequestPlan(15, (1, 2, 3), recall_slots=(40, 41))}
    got_table, got_lens, rows = compact(table, lens, 32, plans)
    assert got_table[0, :5].tolist() == [40, 41, 10, 14, 15]
    assert got_lens[0] == 4 * 32 + 7  # three blocks out, two slots in
    assert rows[0].logical.tolist() == [-1, -1, 0, 4, 5] and rows[0].logical_blocks == 6


def test_a_recall_slots_attention_goes_to_no_block():
    from h2ochat_vllm.worker_state import ScoredRow, StepState

    state = StepState()
    scores = state.begin_step([ScoredRow("a", torch.tensor([-1, 0, 2]), 4)])
    scores[0] = torch.tensor([5.0, 1.0, 2.0])
    assert state.take_scores()["a"].tolist() == [1.0, 0.0, 2.0, 0.0]
