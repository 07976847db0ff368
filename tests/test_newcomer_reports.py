"""Figures and messages that told a newcomer the wrong thing: generate's JSON said recall_slots 0
under an explicit --recall, the status line said "recall 0 pages" beside 21 cold ones, and a narrow
terminal dropped the evictions first."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from h2ochat.chat.conversation import Conversation
from h2ochat.chat.repl import Repl, StreamReader
from h2ochat.chat.settings import ChatSettings
from h2ochat.config import Sampling
from h2ochat.engine.generation import CacheSettings

from test_repl import loaded  # noqa: F401  (the tiny model fixture)

WORDS = "the quick brown fox jumps over the lazy dog " * 12


def test_generate_json_says_what_recall_asked_for_and_why_it_was_not_used(h2ochat_main, tiny_checkpoint):
    result = h2ochat_main("generate", "hello", "--model", str(tiny_checkpoint), "--budget", "64", "--recall", "16",
                          "--page", "8", "-n", "3", "--json", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["recall_slots"] == 0 and record["recall"] is None  # what the cache used
    asked = record["recall_asked"]
    assert asked["recall"] == "16" and asked["recall_slots"] == 16 and asked["recall_slots_used"] == 0
    assert "nothing is evicted" in asked["why"]


def test_generate_text_says_an_explicit_recall_was_not_used(h2ochat_main, tiny_checkpoint):
    result = h2ochat_main("generate", "hello", "--model", str(tiny_checkpoint), "--budget", "64", "--recall", "16",
                          "--page", "8", "-n", "3", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert "note: --recall 16 (16 recall slots) was not used" in result.stderr


def recall_repl(loaded, width: int | None):
    conv = Conversation(loaded.model, loaded.tokenizer, ChatSettings(
        sampling=Sampling(temperature=0.0), max_new_tokens=4, cache=CacheSettings(policy="h2o", budget="32", recall="8", page=4)))
    out = io.StringIO()
    console = Console(file=out, force_terminal=width is not None, width=width or 200, highlight=False, markup=False)
    repl = Repl(conv, console, StreamReader(io.StringIO("")), model_name="a-long-model-name-of-a-hub-repo")
    return conv, repl


def test_the_status_line_names_the_cold_pages_beside_the_pages_brought_in(loaded):
    conv, repl = recall_repl(loaded, None)
    conv.send(WORDS)
    tier = repl.status.summary().tier
    assert tier.cold_pages > 0
    toolbar = repl.toolbar()
    assert " cold pages in" in toolbar and "recall: " in toolbar
    pages = toolbar.split("recall: ")[1].split(" cold pages")[0]
    brought, _, cold = pages.partition(" of ")
    assert float(cold) == pytest.approx(tier.cold_pages, abs=0.051)


@pytest.mark.parametrize("width", [50, 60, 80])
def test_a_narrow_terminal_keeps_the_evictions(loaded, width):
    conv, repl = recall_repl(loaded, width)
    conv.send(WORDS)
    toolbar = repl.toolbar()
    assert "evicted" in toolbar, toolbar
    assert len(toolbar) <= width
