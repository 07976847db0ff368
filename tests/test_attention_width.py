"""How many slot columns a step reads (``kernels.reference.attends_every_column``): a CPU decode step over
bf16 slots that are 70% full reads every column, the empty ones masked, instead of a view of the
first W (which torch's bf16 batched product would take a slow path for). Reading more columns must not
change what the cache computes: the same tokens kept, the logits and scores within bf16 rounding of
the run that reads only the columns in use, for every family."""

from __future__ import annotations

import pytest
import torch

from h2ochat.engine.generation import CacheSettings, forward, prefill
from h2ochat_kernels import reference

from conftest import build_model, random_ids
from cpu_routes import without_attention_kernel  # noqa: F401 (a fixture)

# the torch route's choice: the C attention kernel, where it runs, reads the columns in use as they are
pytestmark = pytest.mark.usefixtures("without_attention_kernel")

SLOTS, PROMPT, STEPS = 24, 6, 14  # the cache fills from 6 of 24 columns to 20: under and over 70%


def run(model, ids, monkeypatch, share: float):
    """Teacher-forced decode with the full-width share at ``share``: logits [B, steps, V], the cache, and
    how many decode steps read every column."""
    monkeypatch.setattr(reference, "FULL_WIDTH_SHARE", share)
    full = []
    choose = reference.attends_every_column
    monkeypatch.setattr(reference, "attends_every_column", lambda *a: full.append(choose(*a)) or full[-1])
    cache = CacheSettings(budget=str(SLOTS), recall=None).build(model)
    with torch.inference_mode():
        logits = [prefill(model, cache, ids[:, :PROMPT])]
        logits += [forward(model, cache, ids[:, t:t + 1])[:, -1] for t in range(PROMPT, PROMPT + STEPS)]
    return torch.stack(logits, 1).float(), cache, sum(full)


def test_reading_every_column_changes_nothing_but_rounding(family, monkeypatch):
    dtype = torch.bfloat16
    model = build_model(family, seed=1).to(dtype)
    ids = random_ids(3, PROMPT + STEPS, torch.Generator().manual_seed(5))
    narrow_logits, narrow, narrow_full = run(model, ids, monkeypatch, share=2.0)  # never (in use <= columns)
    wide_logits, wide, wide_full = run(model, ids, monkeypatch, share=0.0)  # every decode step
    layers = model.config.num_hidden_layers
    assert narrow_full == 0 and wide_full == STEPS * layers  # (the prompt chunk reads the columns in use)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(wide_logits, narrow_logits, rtol=0, atol=4 * eps * narrow_logits.abs().max().item())
    for a, b in zip(narrow.layers, wide.layers):
        assert torch.equal(a.token_index, b.token_index) and a.slots_in_use == b.slots_in_use < SLOTS
        torch.testing.assert_close(b.scores, a.scores, rtol=4 * eps, atol=4 * eps)


def test_only_a_cpu_decode_step_over_bf16_slots_70_percent_full_reads_every_column():
    bf16, fp32 = torch.zeros(1, 1, 30, 4, dtype=torch.bfloat16), torch.zeros(1, 1, 30, 4)
    assert reference.attends_every_column(1, 21, 30, bf16)
    assert not reference.attends_every_column(1, 20, 30, bf16)  # under 70% in use
    assert not reference.attends_every_column(4, 21, 30, bf16)  # a prompt chunk
    assert not reference.attends_every_column(1, 21, 30, fp32)  # fp32 products take the view as it is
    assert not reference.attends_every_column(1, 21, 30, bf16.to(torch.uint8))  # quantised codes
    assert not reference.attends_every_column(1, 21, 30, bf16.half())  # fp16 slots are converted to fp32
