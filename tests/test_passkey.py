"""The pass-key benchmark: trials, scoring, and the masked reference against the real cache."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build_model

from h2ochat.measure import passkey as pk
from h2ochat.engine.generation import CacheSettings

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?!\n'"


class CharTokenizer:
    """One token per character of CHARS (ids 3..): the tiny models' vocabulary holds them all."""

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = [3 + CHARS.index(c) for c in text if c in CHARS]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(CHARS[i - 3] for i in map(int, ids) if 3 <= i < 3 + len(CHARS))


FILLER = "the quick brown fox jumps over the lazy dog. " * 20


def test_recalled_reads_the_digits_the_answer_starts_with():
    assert pk.recalled("12345", " 12345. Remember")
    assert pk.recalled("12345", " 1 2 3 4 5")
    assert not pk.recalled("12345", " 1234")
    assert not pk.recalled("12345", " the key is 9 12345")  # another digit first
    assert not pk.recalled("12345", " no digits")


@pytest.mark.parametrize("depth", [0.0, 0.25, 1.0])
def test_the_key_sits_at_its_depth(depth):
    tok = CharTokenizer()
    filler = tok(FILLER[:200])["input_ids"]
    trial = pk.build_trial(tok, filler, depth, "54321", len(filler))
    text = tok.decode(trial.context[0])
    where = text.index("The pass key is 54321.")
    assert abs(where - 1 - depth * len(filler)) <= 1  # the leading space of the sentence sits at the cut
    assert tok.decode(trial.question[0]) == pk.QUESTION.format(which="")
    assert trial.keys == ["54321"]


def test_two_facts_are_planted_in_depth_order_and_asked_first_then_second():
    tok = CharTokenizer()
    filler = tok(FILLER[:200])["input_ids"]
    trial = pk.build_trial(tok, filler, 0.8, "11111", len(filler), second=("22222", 0.2))
    text = tok.decode(trial.context[0])
    second, first = text.index("The second pass key is 22222."), text.index("The first pass key is 11111.")
    assert second < first and abs(second - 1 - 0.2 * len(filler)) <= 1
    assert tok.decode(trial.question[0]).endswith("The first pass key is")
    assert [k for k, _ in trial.more] == ["22222"] and tok.decode(trial.more[0][1][0]).endswith("The second pass key is")
    assert trial.keys == ["11111", "22222"]


def test_trials_draw_their_own_keys_and_stretches(seed):
    tok = CharTokenizer()
    trials = pk.make_trials(tok, FILLER, [60, 80], [0.1, 0.9], 2, seed=seed)
    assert [(t.length, t.depth, t.window) for t in trials] == [
        (60, 0.1, 0), (60, 0.1, 1), (60, 0.9, 0), (60, 0.9, 1), (80, 0.1, 0), (80, 0.1, 1), (80, 0.9, 0), (80, 0.9, 1)]
    assert all(len(t.key) == 5 and t.key.isdigit() for t in trials)
    with pytest.raises(ValueError, match="fewer than"):
        pk.make_trials(tok, FILLER[:50], [80], [0.5], 1)


def _logits_along(runner_a, runner_b, trial, follow: torch.Tensor):
    """Feed both runners the context, the question and the same answer tokens; their logits each step."""
    pairs = [(runner_a.feed(trial.context), runner_b.feed(trial.context))]
    pairs.append((runner_a.feed(trial.question), runner_b.feed(trial.question)))
    for token in follow:
        ids = token.view(1, 1)
        pairs.append((runner_a.feed(ids), runner_b.feed(ids)))
    return pairs


@pytest.mark.parametrize("policy,slots", [("full", 64), ("h2o", 24), ("mean", 24), ("local", 16)])
def test_masked_reference_without_recall_is_the_real_cache(family, seed, policy, slots):
    """With no recall slots the simulation's hot set is the real cache's: same logits at every step,
    chunked prefill (chunks of 40) and decode, for every family."""
    model = build_model(family, seed=seed, max_position_embeddings=512)
    tok = CharTokenizer()
    trial = pk.build_trial(tok, tok(FILLER[:120])["input_ids"], 0.2, "13579", 120)
    follow = torch.randint(3, VOCAB, (4,))
    real = pk.CacheRow(policy, CacheSettings(policy=policy, budget=str(slots)), chunk=40)
    masked = pk.MaskedRow(policy, policy, slots if policy != "full" else 10**6, 0, chunk=40, question_chunk=40)
    real_run, masked_run = real.runner(model, trial), masked.runner(model, trial)
    for got, want in _pairs_switching(model, real_run, masked_run, trial, follow):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def _pairs_switching(model, real_run, masked_run, trial, follow):
    """The two runners need different attention implementations: switch before each feed."""
    from h2ochat.engine.attention import use_h2o_attention
    from h2ochat.recall.masked import MaskedRecall

    class Switching:
        def __init__(self, runner, attach):
            self.runner, self.attach = runner, attach

        def feed(self, ids):
            self.attach(model)
            return self.runner.feed(ids)

    return _logits_along(Switching(masked_run, MaskedRecall.attach), Switching(real_run, use_h2o_attention), trial, follow)


def test_run_records_both_row_kinds_and_the_real_cache_memory(seed):
    """passkey.run over a real-cache row and a masked-reference row: one record per (row, trial),
    the real row with its device KV bytes (the masked row keeps a full cache: it reports none)."""
    model = build_model("llama", seed=seed, max_position_embeddings=512)
    tok = CharTokenizer()
    trials = pk.make_trials(tok, FILLER, [80], [0.5], 1, seed=seed)
    rows = [pk.CacheRow("h2o 24", CacheSettings(policy="h2o", budget="24"), chunk=40),
            pk.MaskedRow("masked h2o 24", "h2o", 24, 0, chunk=40)]
    results = pk.run(model, tok, trials, rows)
    assert [r["row"] for r in results] == ["h2o 24", "masked h2o 24"]
    layers, kv_heads, head_dim = 2, 2, 16
    assert results[0]["device_kv_bytes"] == layers * 2 * 24 * kv_heads * head_dim * 4
    assert "device_kv_bytes" not in results[1]


# -- the command ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    from checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama-512"), max_position_embeddings=512)


@pytest.fixture(scope="module")
def filler_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("filler") / "fox.txt"
    path.write_text(FILLER)
    return path


def _run(*args):
    from typer.testing import CliRunner

    from h2ochat.cli import app

    result = CliRunner().invoke(app, ["eval", "--task", "passkey", "--dtype", "float32", *args])
    return result.exit_code, result.stdout, result.stderr


def test_passkey_command_json_has_every_row_and_trial(long_checkpoint, filler_file):
    import json

    code, out, err = _run("--model", str(long_checkpoint), "--text", str(filler_file), "--lengths", "40,60",
                          "--depths", "0.1,0.9", "--keys", "1", "--budget", "32", "--policies", "full,h2o",
                          "--recall", "16", "--page", "8", "--json")
    assert code == 0, err
    report = json.loads(out)
    rows = ["full", "h2o 32", "h2o 32 = 16 hot + 16 recall (auto, pages of 8)"]
    assert [s["row"] for s in report["summary"]] == [r for r in rows for _ in range(4)]
    assert len(report["results"]) == 3 * 4
    for result in report["results"]:
        assert result["recalled"] == pk.recalled(result["key"], result["answer"])
        assert result["device_kv_bytes"] > 0
        if "recall" in result["row"]:  # the two-tier rows report the digest (device) and the cold store (host);
            # the default selector on the CPU is exact on the cold store's own keys: no digest bytes of its own
            assert result["digest_device_bytes"] == 0 and result["cold_host_bytes"] > 0 and result["pages_copied"] > 0
    assert {(s["length"], s["depth"]) for s in report["summary"]} == {(40, 0.1), (40, 0.9), (60, 0.1), (60, 0.9)}


def test_passkey_command_two_facts(long_checkpoint, filler_file):
    import json

    code, out, err = _run("--model", str(long_checkpoint), "--text", str(filler_file), "--lengths", "40",
                          "--depths", "0.2", "--keys", "2", "--budget", "32", "--policies", "h2o", "--facts", "2",
                          "--json")
    assert code == 0, err
    for result in json.loads(out)["results"]:
        assert len(result["keys"]) == len(result["answers"]) == 2
        assert result["recalled"] == all(pk.recalled(k, a) for k, a in zip(result["keys"], result["answers"]))


def test_passkey_command_table_and_plot(long_checkpoint, filler_file, tmp_path):
    plot = tmp_path / "passkey.png"
    code, out, err = _run("--model", str(long_checkpoint), "--text", str(filler_file), "--lengths", "40",
                          "--depths", "0.5,0.9", "--keys", "1", "--budget", "32", "--policies", "full,h2o",
                          "--plot", str(plot))
    assert code == 0, err
    assert "h2o 32" in out and "40 tok, depth 0.5" in out
    import matplotlib.image

    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(plot).shape[2] in (3, 4)


def test_passkey_plot_draws_one_bar_per_row_and_cell(tmp_path):
    import matplotlib.pyplot as plt

    from h2ochat.measure import plotting

    summary = [{"row": row, "length": 40, "depth": depth, "recalled": got, "trials": 2}
               for row, got in (("full", 2), ("h2o 32", 0)) for depth in (0.1, 0.9)]
    closed = []
    real_close = plt.close
    plt.close = lambda figure: closed.append(figure) or real_close(figure)
    try:
        plotting.passkey_plot(summary, tmp_path / "p.png")
    finally:
        plt.close = real_close
    heights = sorted(bar.get_height() for bar in closed[0].axes[0].patches)
    assert heights == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("args, message", [
    (["--recall", "40"], "leave the policy some"),
    (["--recall", "12", "--page", "8"], "of --page 8 pages"),
    (["--selector", "magic", "--recall", "16"], "--selector 'magic': choose auto"),
    (["--selector", "int9", "--recall", "16"], "intN (the keys as N-bit codes, N 1-8)"),
    (["--depths", "1.5"], "depths are shares"),
    (["--lengths", "2000"], "fewer than the 2000"),
    (["--task", "quiz"], "--task must be perplexity, passkey, ruler or chat-memory"),
    (["--facts", "3"], "--facts must be 1 or 2"),
    (["--plot", "keys.svg"], "--plot writes a PNG file"),
])
def test_passkey_command_refuses_bad_inputs(long_checkpoint, filler_file, args, message):
    code, out, err = _run("--model", str(long_checkpoint), "--text", str(filler_file), "--lengths", "40",
                          "--budget", "32", "--policies", "h2o", *args)
    assert code == 2, out
    last = err.strip().splitlines()[-1]
    assert last.startswith("h2ochat: error:") and message in last, last
    assert "Traceback" not in err + out


def test_wilson_interval_against_its_formula_and_its_edges():
    """The Wilson interval: at 0 and all hits it still has width (a row's 0/60 is not certain), it holds
    the rate, and at 30/60 it is the textbook 0.5 +- 0.1236 (z = 1.96)."""
    from h2ochat.measure.passkey import wilson_interval

    low, high = wilson_interval(30, 60)
    assert abs(low - 0.3773) < 1e-3 and abs(high - 0.6227) < 1e-3
    assert wilson_interval(0, 60)[0] == 0.0 and 0.05 < wilson_interval(0, 60)[1] < 0.07
    assert wilson_interval(60, 60)[1] == 1.0 and wilson_interval(60, 60)[0] > 0.93
    for hits in range(0, 11):
        low, high = wilson_interval(hits, 10)
        assert low <= hits / 10 <= high


def test_row_totals_count_every_trial_of_a_row_in_order_of_appearance():
    from h2ochat.measure.passkey import row_totals

    results = [{"row": "full", "recalled": True}, {"row": "h2o", "recalled": False},
               {"row": "full", "recalled": False}, {"row": "full", "recalled": True}]
    totals = row_totals(results)
    assert [t["row"] for t in totals] == ["full", "h2o"]
    assert (totals[0]["recalled"], totals[0]["trials"], totals[0]["rate"]) == (2, 3, 0.6667)
    assert totals[1]["interval95"][0] == 0.0
