"""The REPL driven through prompt-toolkit pipe input: slash commands, save/load, Ctrl-C, history."""

from __future__ import annotations

import io
import json
import re

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from h2ochat.chat import ChatSettings, Conversation
from h2ochat.generation import CacheSettings
from h2ochat.models import load
from h2ochat.repl import PromptReader, Repl, history_path
from h2ochat.ui import make_console

ANSI = re.compile(r"\x1b\[")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from checkpoints import write_checkpoint

    return load(str(write_checkpoint(tmp_path_factory.mktemp("repl-llama"), max_position_embeddings=256)), device="cpu")


def drive(loaded, lines: list[str], history=None, file=None, endless=False, **settings):
    """Run a REPL over ``lines`` typed into a prompt-toolkit session; returns (repl, output, code)."""
    settings.setdefault("max_new_tokens", 5)
    conv = Conversation(loaded.model, loaded.tokenizer, ChatSettings(temperature=0.0, cache=CacheSettings(budget="32"),
                                                                     **settings))
    if endless:
        conv.stop_ids = set()  # replies run to max_new_tokens whatever the random model writes
    out = file or io.StringIO()
    with create_pipe_input() as pipe:
        reader = PromptReader(history=history, input=pipe, output=DummyOutput())
        pipe.send_text("".join(line + "\n" for line in lines))
        repl = Repl(conv, make_console(file=out), reader, model_name="tiny")
        code = repl.run()
    return repl, out.getvalue(), code


def test_slash_commands_change_the_settings_they_name(loaded):
    repl, out, code = drive(loaded, ["/set temperature 0.25", "/set top_p 0.8", "/set top_k 4", "/set seed 9",
                                     "/set max_new_tokens 7", "/set system be kind", "/budget 20", "/policy local",
                                     "/bye"])
    s = repl.conv.settings
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_new_tokens, s.system) == (0.25, 0.8, 4, 9, 7, "be kind")
    assert repl.conv.cache.budget.slots == 20 and repl.conv.cache.policy.name == "local"
    assert code == 0
    assert "new cache of 20 slots" in out


def test_bad_values_and_unknown_commands_get_one_line(loaded):
    repl, out, code = drive(loaded, ["/set temperature hot", "/budget lots", "/policy nope", "/frobnicate", "/exit"])
    assert repl.conv.settings.temperature == 0.0 and repl.conv.cache.budget.slots == 32
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 4
    assert "unknown command /frobnicate" in lines[-1] and "/help" in lines[-1]
    assert code == 0


def test_chat_cache_hh_save_clear_load_round_trip(loaded, tmp_path):
    saved = tmp_path / "talk.json"
    repl, out, _ = drive(loaded, ["hello there", '"""', "two lines", 'of text"""', "/cache", "/hh", "/stats",
                                  f"/save {saved}", "/clear", "/load " + str(saved), "/bye"],
                         system="be brief")
    data = json.loads(saved.read_text())
    assert [m["role"] for m in data["messages"]] == ["user", "assistant", "user", "assistant"]
    assert data["messages"][2]["content"] == "two lines\nof text"  # the multi-line block is one message
    assert data["settings"]["system"] == "be brief" and data["settings"]["cache"]["budget"] == "32"
    assert repl.conv.messages == data["messages"]  # /load brought back what /clear dropped
    assert repl.conv.cache.tokens_seen() == len(repl.conv.ids) > 0
    assert "KV cache · policy h2o" in out and "heavy hitter" in out
    assert "2 turns" in out
    assert not ANSI.search(out)  # not a terminal: plain text


def test_hh_marks_evicted_tokens(loaded):
    # the local policy evicts the oldest tokens from every head: some are surely gone everywhere
    repl, out, _ = drive(loaded, ["/policy local", "the quick brown fox jumps over the lazy dog and more", "/hh", "/bye"],
                         max_new_tokens=20, endless=True)
    conv = repl.conv
    legend = out.strip().splitlines()[-1]
    evicted = int(re.findall(r"evicted: (\d+)", legend)[-1])  # the last entry, not "mostly evicted"
    share = conv.cache.cached_token_share()
    assert evicted == int((share == 0).sum()) > 0


class InterruptingFile(io.StringIO):
    """A terminal stand-in that 'receives Ctrl-C' while the reply is written."""

    def __init__(self, after: int):
        super().__init__()
        self.after = after
        self.count = 0

    def write(self, text):
        if text and not text.startswith(("\n", "[", "note", "(")) and self.after is not None:
            self.count += 1
            if self.count == self.after:
                self.after = None
                raise KeyboardInterrupt
        return super().write(text)


def test_ctrl_c_mid_reply_keeps_session_and_partial_text(loaded):
    repl, out, code = drive(loaded, ["tell me a long story", "and another", "/bye"], max_new_tokens=40,
                            file=InterruptingFile(after=2), endless=True)
    messages = repl.conv.messages
    assert messages[1].get("interrupted") is True
    assert "interrupted" in out
    assert len(messages) == 4 and not messages[3].get("interrupted")  # the next turn ran normally
    assert code == 0


def test_ctrl_d_leaves_and_history_persists(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("H2OCHAT_HOME", str(tmp_path))
    path = history_path()
    assert path.parent == tmp_path
    _, _, code = drive(loaded, ["/set top_k 3", "\x04"], history=path)  # then Ctrl-D
    assert code == 0
    assert "/set top_k 3" in path.read_text()


def test_history_defaults_to_the_xdg_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("H2OCHAT_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert history_path() == tmp_path / "h2ochat" / "history"
