"""A long prompt says how far it has been read and how long it has yet to go (the chat's status
line, generate's progress lines), and a turn stopped before its reply began says so, not
"0 prompt tok at 0 tok/s" and "the partial reply is kept". Times are given, never measured here."""

from __future__ import annotations

import io

import pytest

from h2ochat.chat.conversation import Conversation, TurnResult
from h2ochat.chat.prompt_progress import describe_reading, time_left
from h2ochat.chat.repl import Repl, StreamReader
from h2ochat.chat.settings import ChatSettings
from h2ochat.config import Sampling
from h2ochat.chat.status import STATUS_SEPARATOR, fit_figures, status_figures, summarize, turn_summary
from h2ochat.console import make_console
from h2ochat.engine.generation import CacheSettings, Timing

from test_repl import loaded  # noqa: F401  (the tiny model fixture)

WORDS = "the quick brown fox jumps over the lazy dog " * 12


def test_time_left_is_the_rest_at_the_rate_so_far():
    assert time_left(12_000, 200_000, 30.0) == pytest.approx(470.0)
    assert time_left(0, 200_000, 3.0) is None and time_left(5, 5, 1.0) is None
    text = describe_reading(12_000, 200_000, 30.0)
    assert text == "reading the prompt: 12,000 of 200,000 tokens (400 tok/s, about 7m50s left)"


def conversation(loaded, chunk=8):
    return Conversation(loaded.model, loaded.tokenizer, ChatSettings(
        sampling=Sampling(temperature=0.0), max_new_tokens=2, cache=CacheSettings(policy="h2o", budget="32")), prefill_chunk=chunk)


def test_the_chat_reports_the_reading_between_chunks_and_the_status_line_shows_the_time_left(loaded):
    conv = conversation(loaded)
    seen = []
    conv.send(WORDS, on_reading=lambda: seen.append(conv.prompt_reading()))
    reads = [read for read, _, _ in seen]
    totals = {total for _, total, _ in seen}
    assert len(seen) >= 3 and len(totals) == 1 and reads == sorted(reads) and reads[-1] < totals.pop()
    assert conv.prompt_reading() is None  # the turn is over
    figures = status_figures(summarize(conv.cache), Timing(), live=True, reading=(12_000, 200_000, 30.0))
    assert figures["reading"].long == "reading the prompt: 12,000 of 200,000 tokens (400 tok/s, about 7m50s left)"
    assert figures["reading"].short == "prompt 6%, 7m50s left"
    for width in (40, 60, 80, 200):  # the figure moving while nothing else does is the last to go
        assert fit_figures(figures, width).startswith(("reading the prompt", "prompt 6%, 7m50s left"))


def test_a_turn_stopped_while_its_prompt_is_read_says_so(loaded):
    conv = conversation(loaded)
    calls = []

    def stop_after_two_chunks():
        calls.append(1)
        if len(calls) == 2:
            conv.stop_requested = True  # what SIGTERM's handler does

    result = conv.send(WORDS, on_reading=stop_after_two_chunks)
    assert result.interrupted and result.stopped_reading is not None
    read, total, _ = result.stopped_reading
    assert 0 < read < total
    line = turn_summary(result)
    assert line.startswith(f"stopped while reading the prompt: {read:,} of {total:,} tokens read")
    assert "0 prompt tok" not in line and "nothing generated" in line


def test_the_repl_does_not_call_an_unstarted_reply_kept(loaded, monkeypatch):
    conv = conversation(loaded)
    out = io.StringIO()
    repl = Repl(conv, make_console(file=out), StreamReader(io.StringIO(WORDS + "\n")), model_name="tiny")
    real_send = conv.send

    def send(text, on_piece=None, on_reading=None):
        return real_send(text, on_piece, lambda: setattr(conv, "stop_requested", True))

    monkeypatch.setattr(conv, "send", send)
    repl.run()
    text = out.getvalue()
    assert "the partial reply is kept" not in text and "before the reply began" in text
    assert "stopped while reading the prompt" in text


def test_a_summary_of_a_finished_turn_is_unchanged():
    timing = Timing(prompt_tokens=10, prefill_s=1.0, generated_tokens=3, decode_s=1.0)
    line = turn_summary(TurnResult("hi", False, timing, 0.0, []))
    assert line.startswith("10 prompt tok at 10 tok/s")
