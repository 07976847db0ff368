"""`eval --task ruler`: RULER's scorer against known answers, the generation through h2ochat's cache
against the model's own greedy generation, the resumable log, and the one-line refusals."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from typer.testing import CliRunner

from checkpoints import load_tiny, write_checkpoint, writing
from conftest import FAMILIES
from h2ochat.measure import eval_log, ruler
from h2ochat.cli import app
from h2ochat.engine.generation import CacheSettings


def test_string_match_all_is_the_share_of_expected_strings_found():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert ruler.string_match_all("  APPLE\x01pear ", ["apple", "Pear"]) == 1.0  # case-insensitive, cleaned
    assert ruler.string_match_all("nothing here", ["42"]) == 0.0


def test_the_fallback_scorer_agrees_with_lm_evals(monkeypatch):
    pytest.importorskip("lm_eval.tasks.ruler.common_utils")
    cases = [("The numbers are 123 and 456.", ["123", "456", "789"]), (" x\ty ", ["X", "z"]), ("", ["1"])]
    theirs = [ruler.string_match_all(p, o) for p, o in cases]
    import builtins

    real_import = builtins.__import__

    def no_lm_eval(name, *args, **kwargs):
        if name.startswith("lm_eval"):
            raise ImportError(name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    assert [ruler.string_match_all(p, o) for p, o in cases] == theirs


@pytest.mark.parametrize("family", FAMILIES)
def test_the_full_cache_answers_as_the_models_own_greedy_generation(tmp_path_factory, family):
    loaded = load_tiny(tmp_path_factory, family, "ruler", max_position_embeddings=128)
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    ours = ruler.generate(loaded.model, loaded.tokenizer, CacheSettings(policy="full"), prompt, 12, chunk=8)[0]
    ids = loaded.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    loaded.model.set_attn_implementation("sdpa")
    with torch.no_grad():
        reference = loaded.model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=loaded.tokenizer.eos_token_id)
    assert ours == loaded.tokenizer.decode(reference[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_sample_scores_what_the_model_writes_through_an_evicting_cache(tmp_path_factory, family):
    loaded = load_tiny(tmp_path_factory, family, "ruler-score", max_position_embeddings=128)
    from h2ochat.measure.passkey import CacheRow

    row = CacheRow("h2o 16", CacheSettings(policy="h2o", budget="16"), chunk=8)  # a 60-token prompt: it evicts
    prompt = "one two three four five six seven eight nine ten " * 6
    with writing(loaded.model, loaded.tokenizer, " seven") as token:
        piece = loaded.tokenizer.decode([token]).strip()  # the written token's text (a piece of " seven")
        found = ruler.run_sample(loaded.model, loaded.tokenizer, row, ruler.Sample("t", 64, 0, prompt, (piece,), 4))
        half = ruler.run_sample(loaded.model, loaded.tokenizer, row,
                                ruler.Sample("t", 64, 1, prompt, (piece, "nine"), 4))
    # every answer found after one token: the score is 1 whatever follows, so generation stops there
    assert found["score"] == 1.0 and found["stopped_when_found"] and found["answer"].strip() == piece
    assert half["score"] == 0.5  # the scorer can fail: "nine" was never written
    assert not half["stopped_when_found"] and half["answer"].replace(" ", "") == piece * 4  # all 4 tokens spent


# -- the command: planted samples, so neither lm-eval nor a model's luck is needed ------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ruler-cli"), max_position_embeddings=512)


@pytest.fixture
def planted(monkeypatch):
    """Every task's samples: a prompt of numbers and one expected word; the run count of each."""
    calls = []

    def build(tokenizer, task, length, count, seed=42):
        return [ruler.Sample(task, length, i, "10 20 30 40 50 60 70 80 " * 12, (f"{i}",), 3) for i in range(count)]

    real = ruler.run_sample

    def counted(model, tokenizer, row, sample):
        calls.append((row.label, sample.task, sample.index))
        return real(model, tokenizer, row, sample)

    monkeypatch.setattr(ruler, "build_samples", build)
    monkeypatch.setattr(ruler, "check_lm_eval", lambda: None)
    monkeypatch.setattr(ruler, "run_sample", counted)
    return calls


def _run(*args):
    result = CliRunner().invoke(app, ["eval", "--task", "ruler", "--dtype", "float32", *args])
    return result.exit_code, result.stdout, result.stderr


def test_an_interrupted_run_resumes_without_redoing_finished_samples(checkpoint, planted, tmp_path, monkeypatch):
    log = tmp_path / "out" / "ruler.jsonl"
    log.parent.mkdir()  # (--output makes no folder)
    args = ["--model", str(checkpoint), "--lengths", "128", "--samples", "3", "--ruler-tasks",
            "niah_single_1,ruler_vt", "--policies", "full,h2o", "--budget", "0.25", "--output", str(log), "--json"]
    real_add = eval_log.EvalLog.add

    def stop_after_four(self, record):
        real_add(self, record)
        if len(self.records) == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(eval_log.EvalLog, "add", stop_after_four)
    code, _, _ = _run(*args)
    assert code != 0 and len(log.read_text().splitlines()) == 4
    with log.open("a") as out:
        out.write('{"row": "full", "task": "niah_')  # a line cut short by the kill
    monkeypatch.setattr(eval_log.EvalLog, "add", real_add)
    first = list(planted)
    code, out, err = _run(*args)
    assert code == 0, err
    assert len(planted) == 2 * 2 * 3 and not set(planted[4:]) & set(first)  # the four not run again
    records = [json.loads(line) for line in log.read_text().splitlines()[:4] + log.read_text().splitlines()[5:]]
    assert len({(r["row"], r["task"], r["sample"]) for r in records}) == 12
    assert {"row", "task", "length", "sample", "answer", "score", "seconds"} <= set(records[0])
    report = json.loads(out)
    cells = {(c["cache"], c["task"]): c for c in report["summary"]}
    assert set(cells) == {(c, t) for c in ("full", "h2o @ 0.25") for t in ("niah_single_1", "ruler_vt", "average")}
    assert cells[("h2o @ 0.25", "ruler_vt")]["samples"] == 3 and cells[("h2o @ 0.25", "ruler_vt")]["budget_slots"] == 32
    code, _, _ = _run(*args)  # everything done: nothing runs
    assert code == 0 and len(planted) == 12


@pytest.mark.parametrize("args, message", [
    (["--ruler-tasks", "niah_single_2"], "unknown RULER task"),
    (["--samples", "0"], "--samples must be at least 1"),
    (["--lengths", "600"], "position window"),
    (["--output", "/proc/forbidden/ruler.jsonl"], "the folder /proc/forbidden does not exist"),  # (no folder made)
])
def test_bad_arguments_are_one_line(checkpoint, planted, args, message):
    code, out, err = _run("--model", str(checkpoint), "--lengths", "128", *args)
    assert code != 0 and message in err and "Traceback" not in err + out
    assert [line for line in err.splitlines() if message in line] == [err.strip().splitlines()[-1]]  # (above it:
    # transformers' own loading bar)


def test_an_unknown_task_is_one_line():
    result = CliRunner().invoke(app, ["eval", "--task", "rulr"])
    assert result.exit_code != 0 and "--task must be" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_ruler_without_lm_eval_says_how_to_install(checkpoint, monkeypatch):
    def missing():
        raise ValueError(f"--task ruler builds its samples with lm-eval's RULER tasks: {ruler.INSTALL}")

    monkeypatch.setattr(ruler, "check_lm_eval", missing)
    code, _, err = _run("--model", str(checkpoint), "--lengths", "128")
    assert code != 0 and ruler.INSTALL in err


@pytest.mark.slow  # the real model's tokenizer (the tiny byte-level one made the builders' length search run minutes)
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval (the eval extra) is not installed")
@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_lm_evals_builders_make_samples_with_the_tokenizer_offline(task):
    from h2ochat.loading.models import load

    tokenizer = load("smollm2-135m", "cpu", "float32").tokenizer
    length = 1024 if task in ("ruler_vt", "ruler_cwe") else 512  # see the next test
    few, more = ruler.build_samples(tokenizer, task, length, 1), ruler.build_samples(tokenizer, task, length, 2)
    assert len(more) == 2 and all(s.outputs and s.max_new_tokens == ruler.TASKS[task][2] for s in more)
    assert all(len(tokenizer(s.prompt)["input_ids"]) <= length for s in more)
    assert few[0] == more[0] and more[0] != more[1]  # sample 0 is the same whatever the count


@pytest.mark.slow  # the real model's tokenizer
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval (the eval extra) is not installed")
def test_a_length_the_builders_cannot_fill_is_refused():
    """At 512 tokens lm-eval's vt builder loops forever (its shortest prompt does not fit) and cwe's
    samples have no words to find (nothing to score): both are refused."""
    from h2ochat.loading.models import load

    tokenizer = load("smollm2-135m", "cpu", "float32").tokenizer
    with pytest.raises(ValueError, match="ruler_vt needs --lengths of at least"):
        ruler.build_samples(tokenizer, "ruler_vt", 512, 1)
    with pytest.raises(ValueError, match="ruler_cwe builds samples with nothing to find at 512"):
        ruler.build_samples(tokenizer, "ruler_cwe", 512, 1)


def test_the_binomial_interval_is_wilsons():
    from h2ochat.measure.score_table import wilson

    assert wilson(0.0, 25) == pytest.approx((0.0, 0.1332), abs=1e-4)  # known values of the Wilson 95% interval
    assert wilson(0.5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(1.0, 25) == pytest.approx((0.8668, 1.0), abs=1e-4)
