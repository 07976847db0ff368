"""A failed command or turn leaves the chat exactly as it was (issue 15, item 2), and a user's
mistake is one line while a bug shows its traceback (item 8), in the REPL and on the command line."""

from __future__ import annotations

import io
import json

import pytest
from typer.testing import CliRunner

from h2ochat.chat.conversation import Conversation
from h2ochat.chat.settings import ChatSettings
from h2ochat.config import Sampling
from h2ochat.cli import app
from h2ochat.engine.generation import CacheSettings
from h2ochat.chat.history import ConversationLog
from h2ochat.loading.models import load
from h2ochat.chat.repl import Repl
from h2ochat.console import make_console

from seeds import fresh, seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("seed")
runner = CliRunner()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from checkpoints import write_checkpoint

    fresh("model")
    return load(str(write_checkpoint(tmp_path_factory.mktemp("failures-llama"), max_position_embeddings=256)),
                device="cpu", dtype="float32")


def chat(loaded, policy="mean", budget="16", log=None):
    conv = Conversation(loaded.model, loaded.tokenizer,
                        ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=4, cache=CacheSettings(policy=policy, budget=budget)))
    conv.stop_ids = set()  # replies run to max_new_tokens whatever the random model writes
    out = io.StringIO()
    return Repl(conv, make_console(file=out), lambda prompt: "", model_name="tiny", log=log), out


def type_lines(repl, lines):
    typed = iter(lines + ["/bye"])
    repl.read_line = lambda prompt: next(typed)
    return repl.run()


def snapshot(conv: Conversation) -> dict:
    return {"cache": conv.cache, "ids": list(conv.ids), "pending": list(conv.pending), "fed": conv.fed_text,
            "messages": [dict(m) for m in conv.messages], "settings": conv.settings.to_json()}


@pytest.mark.parametrize("command", ["/budget 2", "/policy mean:sinks=40", "/set sinks 30", "/budget 0.001",
                                     "/policy nonsense", "/set budget lots", "/budget 300"])
def test_a_failed_cache_command_leaves_the_chat_as_it_was(loaded, command):
    """`run --policy mean --budget 16`, `/budget 2`: mean keeps 4 sinks, 2 slots cannot hold them. The
    command is refused in one line before anything changes, and the next turn goes on in the same cache."""
    repl, out = chat(loaded)
    type_lines(repl, ["hello there"])
    before = snapshot(repl.conv)
    type_lines(repl, [command])
    after = snapshot(repl.conv)
    assert after == before  # the very same cache object, tokens, text, messages and settings
    errors = [line for line in out.getvalue().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.getvalue()
    type_lines(repl, ["and again"])
    assert [m["role"] for m in repl.conv.messages] == ["user", "assistant"] * 2
    assert repl.conv.cache is before["cache"] and len(repl.conv.ids) > len(before["ids"])
    assert len([line for line in out.getvalue().splitlines() if line.startswith("error:")]) == 1


def test_a_refeed_that_fails_half_way_keeps_the_old_cache(loaded, monkeypatch):
    """The new cache is built and fed before the old one is dropped: a failure while feeding it (out
    of memory, say) leaves the old cache serving the chat."""
    repl, out = chat(loaded)
    type_lines(repl, ["hello there"])
    before = snapshot(repl.conv)

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr("h2ochat.chat.conversation.prefill", no_memory)
    type_lines(repl, ["/budget 20"])
    monkeypatch.undo()
    assert snapshot(repl.conv) == before
    assert "out of memory" in out.getvalue()
    type_lines(repl, ["more"])
    assert repl.conv.cache is before["cache"] and len(repl.conv.messages) == 4


def test_ctrl_c_during_a_re_read_cancels_the_command_and_keeps_the_session(loaded, monkeypatch):
    repl, out = chat(loaded)
    type_lines(repl, ["hello there"])
    before = snapshot(repl.conv)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("h2ochat.chat.conversation.prefill", interrupted)
    assert type_lines(repl, ["/budget 20"]) == 0  # the session goes on to /bye
    monkeypatch.undo()
    assert snapshot(repl.conv) == before and "cancelled" in out.getvalue()


def test_a_failed_turn_leaves_no_unanswered_turn_in_the_file(loaded, tmp_path, monkeypatch):
    log = ConversationLog("tiny", tmp_path)
    repl, out = chat(loaded, log=log)
    type_lines(repl, ["hello there"])
    calls = []

    def broken_render(*args, **kwargs):  # fails before a token is fed: the user message must not stay
        calls.append(1)
        raise RuntimeError("template exploded")

    monkeypatch.setattr(repl.conv, "render", broken_render)
    type_lines(repl, ["this turn fails"])
    monkeypatch.undo()
    assert calls and [m["role"] for m in repl.conv.messages] == ["user", "assistant"]
    stored = json.loads(log.path.read_text())["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"] and stored == repl.conv.messages
    type_lines(repl, ["this one works"])
    assert [m["content"] for m in repl.conv.messages if m["role"] == "user"] == ["hello there", "this one works"]


def test_a_failed_load_keeps_the_chat_and_its_file(loaded, tmp_path):
    """A conversation whose settings this model cannot hold (mean keeps 4 sinks; 0.01 of 256 positions
    is 3 slots) is refused whole: the chat goes on, and its next save writes its own turns to its own file."""
    log = ConversationLog("tiny", tmp_path / "kept")
    repl, out = chat(loaded, log=log)
    type_lines(repl, ["hello there"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "h2ochat-conversation", "version": 1,
                               "settings": {"cache": {"policy": "mean", "budget": "0.01"}},
                               "messages": [{"role": "user", "content": "someone else's words"},
                                            {"role": "assistant", "content": "theirs"}]}))
    before = snapshot(repl.conv)
    own_file, own_id = log.path, log.id
    type_lines(repl, [f"/load {bad}"])
    assert snapshot(repl.conv) == before and log.id == own_id
    type_lines(repl, ["still mine"])
    stored = json.loads(own_file.read_text())["messages"]
    assert [m["content"] for m in stored if m["role"] == "user"] == ["hello there", "still mine"]
    assert "someone else's words" not in own_file.read_text()


# -- item 8: user errors in one line, bugs with their traceback ------------------------------------------
def test_a_bug_in_a_turn_shows_its_traceback_and_the_session_goes_on(loaded, monkeypatch):
    repl, out = chat(loaded)

    def buggy(*args, **kwargs):
        raise ValueError("an internal invariant broke")  # a ValueError is not necessarily the user's

    monkeypatch.setattr("h2ochat.chat.conversation.stream", buggy)
    type_lines(repl, ["hello"])
    monkeypatch.undo()
    text = out.getvalue()
    assert "Traceback" in text and "an internal invariant broke" in text and "buggy" in text
    type_lines(repl, ["hello again"])
    assert [m["role"] for m in repl.conv.messages] == ["user", "assistant"]


@pytest.mark.parametrize("line", ["/set temperature -1", "/set colour blue", "/budget lots", "/load /no/such/file.json",
                                  "/set top_k many"])
def test_user_mistakes_in_the_repl_stay_one_line(loaded, line, monkeypatch):
    monkeypatch.delenv("H2OCHAT_DEBUG", raising=False)
    repl, out = chat(loaded)
    type_lines(repl, [line])
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in out.getvalue()


def test_debug_shows_the_traceback_of_a_user_error_too(loaded, monkeypatch):
    monkeypatch.setenv("H2OCHAT_DEBUG", "1")
    repl, out = chat(loaded)
    type_lines(repl, ["/set temperature -1"])
    assert "Traceback" in out.getvalue() and "temperature must be >= 0" in out.getvalue()


def test_a_bug_on_the_command_line_keeps_its_traceback(tiny_checkpoint, monkeypatch, tmp_path):
    """An unexpected ValueError deep inside (here: while building the cache) is not reported as the
    user's mistake: it propagates with its traceback (exit 1), where a bad option is one line, exit 2."""
    def broken_build(self, model, *args, **kwargs):
        raise ValueError("tensor shapes disagree inside the cache")

    monkeypatch.setattr(CacheSettings, "build", broken_build)
    env = {"NO_COLOR": "1", "H2OCHAT_HOME": str(tmp_path)}
    result = runner.invoke(app, ["run", "--model", str(tiny_checkpoint)], input="hi\n/bye\n", env=env)
    assert result.exit_code == 1 and isinstance(result.exception, ValueError)
    assert "h2ochat: error" not in result.output
    monkeypatch.undo()
    bad = runner.invoke(app, ["run", "--model", str(tiny_checkpoint), "--policy", "mean", "--budget", "2"],
                        input="hi\n/bye\n", env=env)
    lines = [line for line in bad.output.splitlines() if line.strip()]
    assert bad.exit_code == 2 and lines[-1].startswith("h2ochat: error:") and "sinks" in lines[-1]
    assert "Traceback" not in bad.output


def test_debug_on_the_command_line_shows_the_user_errors_traceback(tiny_checkpoint, tmp_path):
    result = runner.invoke(app, ["run", "--model", str(tiny_checkpoint), "--budget", "lots"],
                           env={"H2OCHAT_DEBUG": "1", "H2OCHAT_HOME": str(tmp_path)})
    assert result.exit_code != 2 and isinstance(result.exception, ValueError) and "--budget" in str(result.exception)
