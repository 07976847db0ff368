"""The pass key in a chat (`eval --task passkey --chat-turns N`): N turns through the real chat path."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from h2ochat.measure import passkey as pk
from h2ochat.measure import passkey_chat as pc
from h2ochat.chat.conversation import Conversation
from h2ochat.cli import app
from h2ochat.loading.models import load
from test_passkey import FILLER, filler_file, long_checkpoint  # noqa: F401 (fixtures)


def test_a_chat_trial_is_the_key_then_the_filler_in_turns_then_the_question(long_checkpoint, seed):
    tokenizer = load(str(long_checkpoint), "cpu", "float32").tokenizer
    trials = pc.make_chat_trials(tokenizer, FILLER, [60, 90], 5, 2, seed=seed)
    assert [(t.length, t.window, t.turns) for t in trials] == [(60, 0, 5), (60, 1, 5), (90, 0, 5), (90, 1, 5)]
    ids = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    for trial in trials:
        messages = trial.messages
        assert len(messages) == 5 and trial.key in messages[0] and messages[-1] == pc.QUESTION_MESSAGE
        stretch = tokenizer.decode(pk.filler_stretch(ids, trial.length, trial.window, 2))
        assert "".join(messages[1:-1]).replace(" ", "") == stretch.replace(" ", "")  # the filler, cut in 3
    assert len({t.key for t in trials}) == 4
    with pytest.raises(ValueError, match="at least 3 turns"):
        pc.make_chat_trials(tokenizer, FILLER, [60], 2, 1)


def test_each_row_runs_every_turn_through_the_conversation(long_checkpoint, filler_file, monkeypatch):
    """Every message of the trial is sent, in order, through Conversation.send; one record per
    (row, trial) with the answer scored, the device bytes equal between the policy and its recall row."""
    sent: list[str] = []
    real_send = Conversation.send

    def spy(self, user_text, on_piece=None):
        sent.append(user_text)
        return real_send(self, user_text, on_piece)

    monkeypatch.setattr(Conversation, "send", spy)
    result = CliRunner().invoke(app, ["eval", "--task", "passkey", "--chat-turns", "4", "--model", str(long_checkpoint),
                                      "--dtype", "float32", "--text", str(filler_file), "--lengths", "60", "--keys", "2",
                                      "--budget", "32", "--policies", "full,h2o", "--recall", "16", "--page", "8", "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    rows = ["full", "h2o 32", "h2o 32 = 16 hot + 16 recall (auto, pages of 8)"]
    assert [r["row"] for r in report["results"]] == [row for row in rows for _ in range(2)]
    assert report["chat"]["turns"] == 4
    assert len(sent) == 3 * 2 * 4
    for trial_index, record in enumerate(report["results"]):
        messages = sent[4 * trial_index : 4 * trial_index + 4]
        assert record["key"] in messages[0] and messages[-1] == pc.QUESTION_MESSAGE
        assert record["turns"] == 4 and len(record["replies"]) == 3
        assert record["recalled"] == pk.recalled(record["key"], record["answer"])
        assert record["tokens"] > 60  # the whole conversation went through the cache
    by_row = {r["row"]: r for r in report["results"]}
    assert by_row[rows[2]]["device_kv_bytes"] == by_row[rows[1]]["device_kv_bytes"]
    assert by_row[rows[2]]["pages_copied"] > 0
    assert [s["row"] for s in report["summary"]] == rows


@pytest.mark.parametrize("args, message", [
    (["--chat-turns", "2"], "--chat-turns needs at least 3 turns"),
    (["--chat-turns", "4", "--facts", "2"], "and one fact"),
    (["--chat-turns", "50", "--lengths", "20"], "fewer filler tokens than the 48 filler turns"),
])
def test_bad_chat_arguments_are_one_line(long_checkpoint, filler_file, args, message):
    result = CliRunner().invoke(app, ["eval", "--task", "passkey", "--model", str(long_checkpoint), "--text",
                                      str(filler_file), "--lengths", "40", "--budget", "32", "--policies", "h2o", *args])
    assert result.exit_code == 2, result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("h2ochat: error:") and message in last, last
    assert "Traceback" not in result.stderr + result.stdout


def test_chat_lengths_as_multiples_of_the_slots(long_checkpoint, filler_file):
    """--lengths 2x in a chat: each budget its own filler length, the full cache every one; the
    records carry the conversation's tokens as a multiple of the row's device slots."""
    result = CliRunner().invoke(app, ["eval", "--task", "passkey", "--chat-turns", "3", "--model", str(long_checkpoint),
                                      "--dtype", "float32", "--text", str(filler_file), "--lengths", "2x,40", "--keys", "1",
                                      "--budget", "16,24", "--policies", "full,h2o", "--json"])
    assert result.exit_code == 0, result.stderr
    records = json.loads(result.stdout)["results"]
    assert [(r["row"], r["length"]) for r in records] == [("full", 32), ("full", 40), ("full", 48), ("h2o 16", 32),
                                                          ("h2o 16", 40), ("h2o 24", 40), ("h2o 24", 48)]
    for record in records:
        slots = None if record["row"] == "full" else int(record["row"].split()[1])
        assert record["device_slots"] == slots
        assert record["slots_ratio"] == (round(record["tokens"] / slots, 2) if slots else None)
