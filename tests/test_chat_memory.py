"""`eval --task chat-memory`: facts planted in the first turns of a conversation through the chat
path, filler turns, then a question per fact; scored per fact."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from checkpoints import load_tiny, write_checkpoint, writing
from conftest import FAMILIES
from h2ochat.measure import chat_memory as cm
from h2ochat.chat.conversation import Conversation
from h2ochat.cli import app
from h2ochat.engine.generation import CacheSettings
from h2ochat.measure.passkey import CacheRow


def test_samples_plant_distinct_facts_and_filler_without_them(seed):
    samples = cm.make_samples([0, 3], 2, filler_words=20, seed=seed)
    assert [(s.depth, s.index, len(s.fillers)) for s in samples] == [(0, 0, 0), (0, 1, 0), (3, 0, 3), (3, 1, 3)]
    for sample in samples:
        assert len({f.name for f in sample.facts}) == cm.FACTS == len({f.thing for f in sample.facts})
        assert all(len(f.split()) == 20 and not any(ch.isdigit() for ch in f) for f in sample.fillers)
        assert all(f.question.startswith("Complete the record") and f.code in f.message for f in sample.facts)


def test_a_sample_is_the_same_whatever_the_count():
    """Sample i of 2 is sample i of 5: a log grown with another --samples scores the same conversations."""
    few, more = cm.make_samples([0, 3], 2, filler_words=20), cm.make_samples([0, 3], 5, filler_words=20)
    assert few == [s for s in more if s.index < 2]
    assert len({s.facts for s in more}) == len(more)  # and each has its own facts


@pytest.mark.parametrize("family", FAMILIES)
def test_each_fact_is_scored_through_the_conversation(tmp_path_factory, family, monkeypatch):
    """Facts, filler, then the questions, in order, through Conversation.send; a fact whose code the
    model writes is recalled and one whose code it does not write is not (the scorer can fail)."""
    loaded = load_tiny(tmp_path_factory, family, "chat-memory", max_position_embeddings=512)
    sent: list[str] = []
    real_send = Conversation.send
    monkeypatch.setattr(Conversation, "send", lambda self, text, on_piece=None: (sent.append(text),
                                                                                 real_send(self, text, on_piece))[1])
    sample = cm.make_samples([2], 1, filler_words=12)[0]
    facts = (replace(sample.facts[0], code="7777"),) + sample.facts[1:]  # the written digit's code, then others
    sample = replace(sample, facts=facts)
    row = CacheRow("h2o 48", CacheSettings(policy="h2o", budget="48"))  # the conversation outgrows it
    with writing(loaded.model, loaded.tokenizer, "7"):
        record = cm.run_sample(loaded.model, loaded.tokenizer, row, sample)
    assert sent == [f.message for f in facts] + list(sample.fillers) + [f.question for f in facts]
    assert record["recalled_each"][0] and not any(record["recalled_each"][1:])
    assert record["score"] == pytest.approx(1 / cm.FACTS) and record["tokens"] > 48


def test_the_command_logs_each_sample_and_resumes(tmp_path_factory, tmp_path):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("chat-memory-cli"), max_position_embeddings=1024)
    log = tmp_path / "memory.jsonl"
    args = ["eval", "--task", "chat-memory", "--model", str(checkpoint), "--turns", "0,1", "--samples", "2",
            "--policies", "full,h2o", "--budget", "0.5", "--output", str(log), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    lines = log.read_text().splitlines()
    assert len(lines) == 2 * 2 * 2
    cells = {(c["cache"], c["length"]): c for c in json.loads(result.stdout)["summary"]}
    assert set(cells) == {(c, d) for c in ("full", "h2o @ 0.5") for d in (0, 1)}
    assert all(c["samples"] == 2 and 0 <= c["low"] <= c["score"] <= c["high"] <= 1 for c in cells.values())
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and log.read_text().splitlines() == lines  # nothing ran again
    assert "8 of 8 samples already" in again.stderr


def test_bad_turns_are_one_line():
    result = CliRunner().invoke(app, ["eval", "--task", "chat-memory", "--turns", "a,b"])
    assert result.exit_code != 0 and "--turns takes" in result.stderr
