"""The harder pass-key probes: --lengths as multiples of the device slots, two facts with recall,
and each miss put down to the model, the selector or the cache."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from conftest import FAMILIES
from h2ochat.measure import evaluation as ev
from h2ochat.measure import passkey as pk
from h2ochat.measure.passkey_rows import table_rows
from h2ochat.measure import passkey_probes as probes
from h2ochat.cli import app
from h2ochat.engine.generation import CacheSettings
from test_passkey import FILLER, filler_file  # noqa: F401 (fixture)


def test_lengths_parse_as_tokens_or_multiples_of_the_slots():
    specs = probes.parse_lengths(" 880, 16x,7.5X ,")
    assert [(s.text, s.tokens, s.ratio) for s in specs] == [("880", 880, None), ("16x", None, 16.0),
                                                              ("7.5X", None, 7.5)]
    assert [s.resolve(128) for s in specs] == [880, 2048, 960]


@pytest.mark.parametrize("text, message", [
    ("16y", "token counts (880) or multiples"), ("x", "token counts (880) or multiples"),
    ("0x", "above 0"), ("-3", "above 0"), ("infx", "above 0"), ("nanx", "above 0"), (" , ", "at least one"),
])
def test_bad_lengths_are_refused(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        probes.parse_lengths(text)


def test_a_row_runs_the_plain_lengths_and_its_own_multiples_the_full_cache_all():
    plan = probes.LengthPlan(probes.parse_lengths("880,7x,16x"), [128, 256])
    assert plan.lengths() == [880, 896, 2048, 1792, 4096]
    assert plan.for_slots(128) == {880, 896, 2048} and plan.for_slots(256) == {880, 1792, 4096}
    assert plan.for_slots(None) == set(plan.lengths())
    assert plan.title(2048, 0.5) == "2048 tok (16x 128 slots), depth 0.5" and plan.title(880, 0.1) == "880 tok, depth 0.1"
    assert plan.describe() == {"asked": ["880", "7x", "16x"],
                               "by_device_slots": {"128": [880, 896, 2048], "256": [880, 1792, 4096]}}
    full, small = pk.CacheRow("full", CacheSettings(policy="full", budget="128")), \
        pk.CacheRow("h2o 128", CacheSettings(policy="h2o", budget="128"))
    assert full.device_slots is None and small.device_slots == 128

    class T:
        length = 1792

    assert plan.wanted(full, T) and not plan.wanted(small, T)


def test_budgets_against_relative_lengths():
    assert probes.budgets_for("256,128", probes.parse_lengths("16x"), ev.parse_budgets) == [128, 256]
    assert probes.budgets_for("0.5", probes.parse_lengths("100,200"), ev.parse_budgets) == [50]
    with pytest.raises(ValueError, match="needs --budget in slots"):
        probes.budgets_for("0.2", probes.parse_lengths("100,16x"), ev.parse_budgets)


# -- misses attributed ----------------------------------------------------------------------------

def _rows():
    rot = CacheSettings(policy="h2o", budget="64", recall="32", selector="rot4")
    return [pk.CacheRow("full", CacheSettings(policy="full", budget="64")),
            pk.CacheRow("h2o", CacheSettings(policy="h2o", budget="64")),
            pk.CacheRow("rot4", rot), pk.CacheRow("exact", replace(rot, selector="exact")),
            pk.CacheRow("int4 alone", CacheSettings(policy="h2o", budget="64", recall="16", selector="int4"))]


def _cause(row: str, fact: int, got: dict) -> str | None:
    """The rule written out case by case, from the full cache's and the exact row's answers."""
    if got[row][fact]:
        return None
    if not got["full"][fact]:
        return "model"
    if row == "rot4":
        return "selector" if got["exact"][fact] else "cache"
    return "cache or selector" if row == "int4 alone" else "cache"


@pytest.mark.parametrize("facts", [1, 2])
def test_each_miss_is_put_down_to_the_model_the_selector_or_the_cache(seed, facts):
    rng = random.Random(seed)
    rows = _rows()
    results, truth = [], []
    for window in range(40):  # random outcomes per row and fact: every case comes up
        got = {row.label: [rng.random() < 0.5 for _ in range(facts)] for row in rows}
        truth.append(got)
        for row in rows:
            record = {"row": row.label, "length": 100, "depth": 0.5, "window": window, "key": f"{window:05d}",
                      "recalled": all(got[row.label])}
            if facts == 2:
                record["recalled_each"] = got[row.label]
            results.append(record)
    out = probes.attribute(results, rows)
    assert [r["row"] for r in out] == [r["row"] for r in results]
    seen = set()
    for record in out:
        got = truth[record["window"]]
        if record["row"] == "full":
            assert "miss_causes" not in record
            continue
        assert record["miss_causes"] == [_cause(record["row"], f, got) for f in range(facts)]
        seen.update(record["miss_causes"])
    assert seen == {None, *probes.CAUSES}
    counts = probes.miss_counts(out)
    assert counts["rot4"].get("selector", 0) == sum(c == "selector" for r in out if r["row"] == "rot4"
                                                    for c in r["miss_causes"])
    assert probes.attribute(results[1:2], rows) == results[1:2]  # no full cache beside: nothing to put down


# -- the command on tiny random models ------------------------------------------------------------

@pytest.fixture(scope="module", params=FAMILIES)
def family_checkpoint(request, tmp_path_factory):
    from checkpoints import write_checkpoint

    return request.param, write_checkpoint(tmp_path_factory.mktemp(f"tiny-{request.param}-512"), request.param,
                                           max_position_embeddings=512)


def _invoke(*args):
    result = CliRunner(env={"COLUMNS": "300"}).invoke(app, ["eval", "--task", "passkey", "--dtype", "float32", *args])
    return result.exit_code, result.stdout, result.stderr


def test_the_16x_probe_with_two_facts_and_the_exact_selector_beside(family_checkpoint, filler_file):
    """7x and 16x the slots in one run: each row its own lengths, the full cache both, every record
    with its context length, device slots and ratio, both facts scored, misses put down."""
    family, checkpoint = family_checkpoint
    code, out, err = _invoke("--model", str(checkpoint), "--text", str(filler_file), "--lengths", "7x,16x",
                             "--depths", "0.3", "--keys", "1", "--budget", "12", "--policies", "full,h2o",
                             "--recall", "4", "--page", "2", "--selector", "rot4,exact", "--facts", "2", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["length_plan"] == {"asked": ["7x", "16x"], "by_device_slots": {"12": [84, 192]}}
    rows = ["full", "h2o 12", "h2o 12 = 8 hot + 4 recall (rot4, pages of 2)",
            "h2o 12 = 8 hot + 4 recall (exact, pages of 2)"]
    assert [(r["row"], r["length"]) for r in report["results"]] == [(row, n) for row in rows for n in (84, 192)]
    full = {r["length"]: r for r in report["results"] if r["row"] == "full"}
    for record in report["results"]:
        assert record["context_tokens"] > record["length"]  # the filler and the two key sentences
        assert len(record["keys"]) == len(record["answers"]) == len(record["recalled_each"]) == 2
        assert record["recalled_each"] == [pk.recalled(k, a) for k, a in zip(record["keys"], record["answers"])]
        if record["row"] == "full":
            assert record["device_slots"] is None and record["slots_ratio"] is None
            continue
        assert record["device_slots"] == 12 and record["slots_ratio"] == round(record["context_tokens"] / 12, 2)
        reference = full[record["length"]]["recalled_each"]
        for got, cause, ref in zip(record["recalled_each"], record["miss_causes"], reference):
            assert (cause is None) == got and (cause == "model") == (not got and not ref)
    for entry in report["summary"]:
        assert len(entry["recalled_per_fact"]) == 2 and entry["recalled"] <= min(entry["recalled_per_fact"])
    # the table: a column per (length, depth) named by how it was asked, each fact's count, the misses
    plan = probes.LengthPlan(probes.parse_lengths("7x,16x"), [12])
    titles, cells = probes.with_misses(*table_rows(report["summary"], plan.title), report["misses"])
    assert titles[1:3] == ["84 tok (7x 12 slots), depth 0.3", "192 tok (16x 12 slots), depth 0.3"]
    assert titles[-1] == "misses: put down to" and [c[0] for c in cells] == rows
    assert cells[0][-1] == "-" and all(c[1].startswith(f"{s['recalled']}/1 (1st ") for c, s in zip(cells, report["summary"][::2]))


@pytest.mark.parametrize("args, message", [
    (["--lengths", "16y"], "--lengths takes comma-separated token counts (880) or multiples"),
    (["--lengths", "0x"], "--lengths entries must be above 0"),
    (["--lengths", "16x", "--budget", "0.2"], "needs --budget in slots"),
    (["--lengths", "200x"], "fewer than the 6400"),
])
def test_bad_lengths_are_one_line_errors(filler_file, tiny_checkpoint, args, message):
    code, out, err = _invoke("--model", str(tiny_checkpoint), "--text", str(filler_file), "--budget", "32",
                             "--policies", "h2o", *args)
    assert code == 2, out
    last = err.strip().splitlines()[-1]
    assert last.startswith("h2ochat: error:") and message in last, last
    assert "Traceback" not in err + out


def test_slot_formats_side_by_side_with_recall(family_checkpoint, filler_file):
    """--kv-dtype auto,int8: every row again with int8 slots (recall included), named with it, each record
    carrying its slot format; the full cache once."""
    code, out, err = _invoke("--model", str(family_checkpoint[1]), "--text", str(filler_file), "--lengths", "7x",
                             "--depths", "0.5", "--keys", "1", "--budget", "12", "--policies", "full,h2o",
                             "--recall", "4", "--page", "2", "--kv-dtype", "auto,int8", "--json")
    assert code == 0, err
    results = json.loads(out)["results"]
    recall = "h2o 12 = 8 hot + 4 recall (auto, pages of 2)"
    assert [(r["row"], r["kv_dtype"]) for r in results] == [
        ("full", "auto"), ("h2o 12", "auto"), (recall, "auto"), ("h2o 12 [int8]", "int8"), (f"{recall} [int8]", "int8")]
    assert all(r["device_slots"] == 12 for r in results[1:])
