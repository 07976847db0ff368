"""`h2ochat eval --recall`: perplexity through the two-tier cache beside the same policy without it.

A recall row runs as a batch of its own (the two-tier cache serves one policy); its perplexity is
checked against the masked reference (``h2ochat.recall.masked``: every key kept, the attention
masked to hot + recalled tokens) fed one token at a time, its device KV bytes against the plain
policy's at the same budget and against the slots counted by hand."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from typer.testing import CliRunner

from conftest import EXACT, build_model, random_ids
from h2ochat.measure import evaluation as ev
from h2ochat.engine.attention import use_h2o_attention
from h2ochat.cli import app
from h2ochat.recall.masked import MaskedRecall
from test_eval import text_file  # noqa: F401 (fixture)
from test_passkey import long_checkpoint  # noqa: F401 (fixture)

SLOTS, RECALL, PAGE = 20, 8, 4
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # the tiny models' (tests/conftest.py), float32


def _masked_nll(model, ids, policy, selector) -> torch.Tensor:
    """The slow reference: NLL of each next token, the text fed one token per forward."""
    sim = MaskedRecall(LAYERS, policy, SLOTS - RECALL, RECALL, PAGE, selector, grouping="eviction", measure=False,
                       staged=True)  # (the real tier stages a decode step's victim: recall.step.StagingPage)
    MaskedRecall.attach(model)
    try:
        logits = [sim.forward(model, ids[i : i + 1].view(1, 1)) for i in range(len(ids) - 1)]
    finally:
        use_h2o_attention(model)
    return ev.token_nll(torch.stack(logits, dim=1), ids[1:].unsqueeze(0))[0]


@pytest.mark.parametrize("policy,selector", [("h2o", "int4"), ("mean", "exact")])
def test_a_recall_rows_perplexity_is_the_masked_reference(family, seed, policy, selector):
    model = build_model(family, seed=seed, max_position_embeddings=256)
    ids = random_ids(1, 64)[0]
    recalls = ev.recall_settings(str(RECALL), str(PAGE), selector=selector, cold_dtype=EXACT)
    rows = ev.build_rows(["full", policy], [SLOTS], len(ids), recalls=recalls, seed=seed)
    results = {r.row.label: r for r in ev.evaluate_rows(model, ids, rows)}
    recall = results[f"{policy} + recall {RECALL} ({selector}, pages of {PAGE})"]
    want = _masked_nll(model, ids, policy, selector)
    torch.testing.assert_close(recall.nll, want.double(), atol=5e-4, rtol=1e-4)
    assert recall.memory["pages_copied"] > 0  # tokens were recalled
    # the recall row reads differently from the policy alone once the policy evicts
    first = ev.first_evicted_prediction(SLOTS - RECALL)
    assert not torch.allclose(recall.nll[first:], results[policy].nll[first:], atol=1e-4)
    records = {r["policy"]: r for r in ev.records(list(results.values()), [SLOTS])}
    record = records[recall.row.label]
    assert record["perplexity"] == pytest.approx(math.exp(want.double().mean().item()), rel=1e-4)
    assert record["perplexity_vs_policy"] == pytest.approx(record["perplexity"] / records[policy]["perplexity"])
    assert record["without_recall"] == policy and record["hot_slots"] == SLOTS - RECALL


def test_recall_rows_hold_the_policys_device_bytes_and_run_alone(seed):
    model = build_model("llama", seed=seed, max_position_embeddings=256)
    ids = random_ids(1, 48)[0]
    recalls = ev.recall_settings("8,0.5", "2,4", selector="int4")  # (2 pages at least: one stages)
    rows = ev.build_rows(["full", "h2o", "mean"], [16, 32], len(ids), recalls=recalls, seed=seed)
    assert [len(batch) for batch in ev.batches(rows)] == [5] + [1] * 16  # 2 policies x 2 budgets x 4 settings
    records = ev.records(ev.evaluate_rows(model, ids, rows), [16, 32])
    plain = {(r["policy"], r["budget_slots"]): r for r in records}
    recall_records = [r for r in records if "without_recall" in r]
    assert len(recall_records) == 16
    for record in recall_records:
        slots = record["budget_slots"]
        assert record["device_kv_bytes"] == plain[(record["without_recall"], slots)]["device_kv_bytes"] \
            == LAYERS * 2 * slots * KV_HEADS * HEAD_DIM * 4
        assert record["recall_slots"] == slots - record["hot_slots"]
        assert record["digest_device_bytes"] > 0 and record["cold_host_bytes"] > 0
    assert {r["recall_slots"] for r in recall_records if r["budget_slots"] == 32} == {8, 16}


# -- the command ----------------------------------------------------------------------------------

def run(*args):
    result = CliRunner().invoke(app, ["eval", "--dtype", "float32", *args])  # (pinned: auto is bf16 on some CPUs)
    return result.exit_code, result.stdout, result.stderr


def test_eval_recall_json_and_table(long_checkpoint, text_file):
    common = ("--model", str(long_checkpoint), "--text", str(text_file), "--tokens", "60", "--budget", "16,24",
              "--policies", "full,h2o", "--recall", "8", "--page", "4")
    code, out, err = run(*common, "--json")
    assert code == 0, err
    report = json.loads(out)
    label = "h2o + recall 8 (auto, pages of 4)"
    assert {(r["policy"], r["budget_slots"]) for r in report["results"]} == {
        (p, b) for p in ("full", "h2o", label) for b in (16, 24)}
    assert report["recall"] == [{"recall": "8", "page": 4, "selector": "auto", "cold_dtype": "auto",
                                 "cold_limit": None, "recall_every": 1, "recall_rest": "auto"}]
    by = {(r["policy"], r["budget_slots"]): r for r in report["results"]}
    for slots in (16, 24):
        assert by[(label, slots)]["device_kv_bytes"] == by[("h2o", slots)]["device_kv_bytes"]
        assert by[(label, slots)]["perplexity_vs_policy"] == pytest.approx(
            by[(label, slots)]["perplexity"] / by[("h2o", slots)]["perplexity"])
    assert report["speed"]["batches"] == 3  # the plain rows together, each recall row alone
    code, out, err = run(*common)
    assert code == 0, err
    assert "h2o + recall 8" in out and re.search(r"\[\d+\.\d{3}x", out)  # the ratio to h2o beside the cell


@pytest.mark.parametrize("args, message", [
    (["--recall", "16"], "--recall 16 takes all 16 slots of the budget"),
    (["--recall", "6", "--page", "4"], "whole number (>= 2) of --page 4 pages"),
    (["--recall", "8", "--page", "four"], "--page takes comma-separated numbers"),
    (["--recall", "8", "--page", "4", "--selector", "quest4"], "--selector 'quest4': choose auto"),
    (["--recall", "8", "--page", "4", "--cold-dtype", "int3"], "--cold-dtype must be one of"),
    (["--recall", "many"], "--recall must be a slot count like 64"),
    (["--chat-turns", "4"], "--chat-turns is for --task passkey"),
])
def test_eval_recall_refuses_bad_arguments_in_one_line(long_checkpoint, text_file, args, message):
    code, out, err = run("--model", str(long_checkpoint), "--text", str(text_file), "--tokens", "40", "--budget", "16",
                         "--policies", "h2o", *args)
    assert code == 2, out
    last = err.strip().splitlines()[-1]
    assert last.startswith("h2ochat: error:") and message in last, last
    assert "Traceback" not in err + out


def test_recall_settings_multiply_shares_pages_and_selectors():
    settings = ev.recall_settings("8,0.5", "4,8", selector="rot4, quest,rot4")
    assert [(s.recall, s.page, s.selector) for s in settings] == [
        (r, p, sel) for r in ("8", "0.5") for p in (4, 8) for sel in ("rot4", "quest")]
    assert {s.selector for s in ev.recall_settings("8", "4")} == {ev.CacheSettings.selector}
    # 0 (or off) is no recall row, as in the chat; auto names no one setting for a table
    assert [s.recall for s in ev.recall_settings("0,8,off", "4")] == ["8"] and ev.recall_settings("0", "4") == []
    with pytest.raises(ValueError, match="not auto"):
        ev.recall_settings("auto", "4")
