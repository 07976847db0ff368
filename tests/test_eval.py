"""`h2ochat eval`: the batched per-row-policy cache against plain single-policy caches, perplexity
against a plain forward, and the command's JSON, plot and refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from conftest import build_model, random_ids
from h2ochat.measure import evaluation as ev
from h2ochat.cli import app
from h2ochat.engine.generation import CacheSettings, forward
from lockstep import EvictionRecorder

POLICIES = ("full", "h2o", "local", "sink", "random")
# every registered policy, plus the knobs that change what a layer holds or ranks by
ALL_POLICIES = (*POLICIES, "decay", "mean", "tova", "decay:value_eps=0.01", "h2o:layer_shape=0.5",
                "mean:layer_shape=-0.5")



def unbatched_nll(model, ids, policy, slots, seed):
    """Reference: the plain H2OCache of one policy, fed one token per forward from the start. Also
    returns how many predictions come before the first eviction whose two lowest candidates tie
    within rounding: the batched run (other sums, other rounding) may drop the other one, and from
    the next prediction on the two attend different tokens."""
    cache = CacheSettings(policy=policy, budget=str(slots), positions="absolute", seed=seed).build(model)
    nll, comparable = [], None
    recorder = EvictionRecorder(cache)
    with recorder.recording():
        for i in range(len(ids) - 1):
            logits = forward(model, cache, ids[i : i + 1].unsqueeze(0))
            nll.append(ev.token_nll(logits, ids[i + 1 : i + 2].unsqueeze(0))[0, 0])
            if recorder.near_tie and comparable is None:
                comparable = i + 1  # this prediction came before that eviction
    return torch.stack(nll), comparable or len(nll)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_batched_rows_equal_each_policy_alone(family):
    seed = int(torch.randint(0, 10_000, ()).item())
    model = build_model(family, seed=seed)
    ids = random_ids(1, 32)[0]
    rows = ev.build_rows(ALL_POLICIES, [6, 13], len(ids), heavy_ratio=0.4, sinks=2, seed=seed)
    assert len(rows) == 1 + (len(ALL_POLICIES) - 1) * 2
    results = ev.evaluate_rows(model, ids, rows)
    for result in results:
        row = result.row
        ref, comparable = unbatched_nll(model, ids, row.policy, row.slots, seed)
        torch.testing.assert_close(result.nll[:comparable], ref[:comparable], atol=2e-5, rtol=1e-5,
                                   msg=lambda m: f"{row.policy.label} at {row.slots} slots, seed={seed}: {m}")


def test_row_batches_split_the_same_way():
    model = build_model("llama", seed=3)
    ids = random_ids(1, 24)[0]
    rows = ev.build_rows(POLICIES, [5, 9], len(ids), seed=1)
    together = ev.evaluate_rows(model, ids, rows, max_rows=16)
    split = ev.evaluate_rows(model, ids, rows, max_rows=3)
    for a, b in zip(together, split):
        assert a.row is b.row
        _, comparable = unbatched_nll(model, ids, a.row.policy, a.row.slots, 1)  # up to an eviction tie
        torch.testing.assert_close(a.nll[:comparable], b.nll[:comparable], atol=2e-5, rtol=1e-5)


def test_full_perplexity_equals_one_plain_forward(family):
    model = build_model(family)
    ids = random_ids(1, 50)[0]
    [result] = ev.evaluate_rows(model, ids, ev.build_rows(["full"], [8], len(ids)))
    with torch.inference_mode():
        logits = model(input_ids=ids.unsqueeze(0), use_cache=False).logits
    plain = ev.token_nll(logits[:, :-1], ids[1:].unsqueeze(0))[0]
    torch.testing.assert_close(result.nll, plain, atol=2e-5, rtol=1e-5)
    assert ev.perplexity(result.nll) == pytest.approx(math.exp(plain.mean().item()), rel=1e-5)


def test_local_with_a_budget_covering_the_text_equals_full():
    model = build_model("neox")
    ids = random_ids(1, 33)[0]
    full, local = ev.evaluate_rows(model, ids, ev.build_rows(["full", "local"], [len(ids)], len(ids)))
    torch.testing.assert_close(local.nll, full.nll, atol=2e-5, rtol=1e-5)
    [record] = [r for r in ev.records([full, local], [len(ids)]) if r["policy"] == "local"]
    assert record["perplexity_after_fill"] is None  # nothing was ever evicted


def test_policies_agree_until_the_first_eviction_then_differ():
    model = build_model("llama", seed=5)
    ids = random_ids(1, 48)[0]
    slots = 10
    results = {r.row.policy.name: r.nll for r in ev.evaluate_rows(model, ids, ev.build_rows(POLICIES, [slots], len(ids)))}
    first = ev.first_evicted_prediction(slots)
    for name, nll in results.items():
        torch.testing.assert_close(nll[:first], results["full"][:first], atol=2e-5, rtol=1e-5, msg=name)
    assert not torch.allclose(results["local"][first:], results["full"][first:], atol=1e-4)
    assert not torch.allclose(results["h2o"][first:], results["local"][first:], atol=1e-4)


def test_records_shape_and_ratios():
    model = build_model("opt")
    ids = random_ids(1, 40)[0]
    budgets = [8, 16]
    results = ev.evaluate_rows(model, ids, ev.build_rows(POLICIES, budgets, len(ids)))
    records = ev.records(results, budgets)
    assert len(records) == len(POLICIES) * len(budgets)
    assert {(r["policy"], r["budget_slots"]) for r in records} == {(p, b) for p in POLICIES for b in budgets}
    full = {r["budget_slots"]: r for r in records if r["policy"] == "full"}
    for r in records:
        assert r["tokens"] == len(ids)
        assert r["perplexity"] > 1 and r["perplexity_after_fill"] > 1
    # full's after-fill numbers cover the same predictions as the evicting rows at that budget
    assert full[8]["perplexity"] == full[16]["perplexity"]
    assert full[8]["perplexity_after_fill"] != full[16]["perplexity_after_fill"]


def test_budget_parsing_and_refusals():
    assert ev.parse_budgets("0.25, 64,64", 200) == [50, 64]
    with pytest.raises(ValueError, match="unknown policy"):
        ev.parse_policies("h2o,nope")
    with pytest.raises(ValueError, match="fewer than the 64-slot budget"):
        ev.check_inputs(40, [16, 64], 1000)
    with pytest.raises(ValueError, match="position limit"):
        ev.check_inputs(80, [16], 64)


# -- the command ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "fox.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. once upon a time there was a dragon. " * 20)
    return path


def run(*args):
    result = CliRunner().invoke(app, ["eval", "--dtype", "float32", *args])  # (pinned: auto is bf16 on some CPUs)
    return result.exit_code, result.stdout, result.stderr


def test_eval_command_json_and_plot(tiny_checkpoint, text_file, tmp_path):
    plot = tmp_path / "ppl.png"
    code, out, err = run("--model", str(tiny_checkpoint), "--text", str(text_file), "--tokens", "40",
                         "--budget", "8,16", "--policies", "full,h2o,local", "--json", "--plot", str(plot))
    assert code == 0, err
    report = json.loads(out)
    assert report["text"] == "fox.txt" and report["tokens"] == 40
    assert {(r["policy"], r["budget_slots"]) for r in report["results"]} == {
        (p, b) for p in ("full", "h2o", "local") for b in (8, 16)}
    for record in report["results"]:
        assert set(record) >= {"policy", "budget_slots", "tokens", "perplexity", "perplexity_after_fill"}
    assert report["speed"]["forwards"] > 0
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(plot).shape[2] in (3, 4)


def test_eval_command_table(tiny_checkpoint, text_file):
    code, out, err = run("--model", str(tiny_checkpoint), "--text", str(text_file), "--tokens", "30",
                         "--budget", "8", "--policies", "full,local")
    assert code == 0, err
    assert "local" in out and "x)" in out


@pytest.mark.parametrize("args, message", [
    (["--tokens", "40", "--budget", "500"], "fewer than the 500-slot budget"),
    (["--policies", "h2o,bogus"], "unknown policy 'bogus'"),
    (["--plot", "out.jpg"], "PNG"),
    (["--tokens", "200", "--budget", "16"], "position limit"),
])
def test_eval_command_refuses_bad_inputs(tiny_checkpoint, text_file, args, message):
    code, out, err = run("--model", str(tiny_checkpoint), "--text", str(text_file), *args)
    assert code == 2
    last = err.strip().splitlines()[-1]  # earlier lines: transformers' weight-loading bar
    assert last.startswith("h2ochat: error:") and message in last
    assert "Traceback" not in err + out
