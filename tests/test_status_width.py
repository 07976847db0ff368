"""The chat's status line fits the terminal (issue 31, item 2): never longer than the width, the most
telling figure (slots held) always there, and as the width grows the next most telling ones come in
the documented order (status.STATUS_ORDER): evictions, recall, KV bytes, speed, threads.

A chat with a tiny random model of each family, a recall tier and the thread count set, so that every
figure the line can show is there; its full line is far wider than 80 columns.
"""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from h2ochat import threads
from h2ochat.console import make_console
from h2ochat.chat.conversation import Conversation
from h2ochat.chat.settings import ChatSettings
from h2ochat.config import Sampling
from h2ochat.engine.generation import CacheSettings
from h2ochat.chat.repl import Repl

from seeds import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("seed")
HELD = re.compile(r"^\d+(\.\d+)?/\d+(\.\d+)? slots held")
# what marks each figure in its long or short form, in the order they must come in
MARKS = {"evicted": " evicted", "recall": "recall", "memory": "KV ", "threads": "thread"}


@pytest.fixture(scope="module", params=["opt", "llama", "neox"])
def loaded(request, tmp_path_factory):
    from checkpoints import load_tiny

    return load_tiny(tmp_path_factory, request.param, "status", max_position_embeddings=256)


@pytest.fixture
def repl(loaded, monkeypatch):
    monkeypatch.setattr(threads, "_chosen", 2)  # as --threads 2 sets it
    cache = CacheSettings(policy="h2o", budget="24", recall="8", page=4, selector="exact")
    conv = Conversation(loaded.model, loaded.tokenizer, ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=8, cache=cache))
    conv.stop_ids = set()
    repl = Repl(conv, make_console(file=io.StringIO()), lambda prompt: "", model_name="tiny")
    repl.handle("the quick brown fox jumps over the lazy dog")
    repl.handle("once upon a time there was a dragon")
    return repl


def test_the_full_line_is_wider_than_a_terminal(repl):
    full = repl.status(live=True)
    assert len(full) > 200  # what the issue saw: about 260 columns
    for mark in MARKS.values():
        assert mark in full


@pytest.mark.parametrize("width", [40, 80, 120, 250])
@pytest.mark.parametrize("live", [False, True])
def test_the_line_fits_the_width_and_keeps_the_most_telling_figures(repl, width, live):
    line = repl.status(live=live, width=width)
    assert len(line) <= width
    assert HELD.match(line), line
    shown = [name for name, mark in MARKS.items() if mark in line]
    assert shown == list(MARKS)[: len(shown)], line  # a figure shows only with every more telling one
    if width >= 80:
        assert {"evicted", "recall", "memory"} <= set(shown), line  # what the issue could not see at 80
    if width >= 120:
        assert "threads" in shown, line
    wider = repl.status(live=live, width=width * 2)
    assert len([m for m in MARKS.values() if m in wider]) >= len(shown)  # more room never shows less


def test_a_terminal_s_toolbar_and_live_line_fit_it(repl):
    for width in (40, 80, 120):
        repl.console = Console(file=io.StringIO(), force_terminal=True, width=width)
        assert len(repl.toolbar()) <= width
        assert len(repl.status(live=True, width=repl.status_width())) <= width
        assert "slots held" in repl.toolbar()


def test_off_a_terminal_the_line_is_whole(repl):
    assert repl.status_width() is None  # a pipe or a file: every figure, for grep and for logs
    assert repl.toolbar().endswith(repl.status(live=False))
