"""Nothing the user wrote is lost: an unfinished \"\"\" block is sent, not dropped; `story --out`,
`/save` and `eval --plot` refuse to replace a file unless told to; no write makes folders."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from h2ochat.chat.conversation import Conversation
from h2ochat.chat.repl import Repl, StreamReader
from h2ochat.chat.settings import ChatSettings
from h2ochat.config import Sampling
from h2ochat.cli import main
from h2ochat.console import make_console
from h2ochat.engine.generation import CacheSettings

from test_repl import drive, loaded  # noqa: F401  (the tiny model fixture)


def piped(loaded, text: str):
    conv = Conversation(loaded.model, loaded.tokenizer,
                        ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=3, cache=CacheSettings(policy="h2o", budget="32")))
    out = io.StringIO()
    repl = Repl(conv, make_console(file=out), StreamReader(io.StringIO(text)), model_name="tiny")
    return repl, out.getvalue, repl.run()


# -- item 1: an open """ block at the end of the input -------------------------------------------
def test_an_unfinished_block_at_the_end_of_piped_input_is_sent(loaded):
    repl, output, code = piped(loaded, 'Hello\n"""\nline one\nline two\n')
    users = [m["content"] for m in repl.conv.messages if m["role"] == "user"]
    assert users == ["Hello", "line one\nline two"]
    assert code == 0 and "ended inside" in output()


def test_ctrl_d_inside_a_block_sends_the_lines_then_leaves(loaded):
    lines = iter(['"""first', "second"])

    def read_line(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    conv = Conversation(loaded.model, loaded.tokenizer,
                        ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=3, cache=CacheSettings(policy="h2o", budget="32")))
    repl = Repl(conv, make_console(file=io.StringIO()), read_line, model_name="tiny")
    assert repl.run() == 0
    assert [m["content"] for m in conv.messages if m["role"] == "user"] == ["first\nsecond"]


def test_an_empty_open_block_at_the_end_sends_nothing(loaded):
    repl, _, code = piped(loaded, 'Hello\n"""\n')
    assert [m["content"] for m in repl.conv.messages if m["role"] == "user"] == ["Hello"] and code == 0


# -- item 3: /save ----------------------------------------------------------------------------------
def test_save_refuses_to_replace_a_file_it_did_not_write(loaded, tmp_path):
    story = tmp_path / "story.txt"
    story.write_text("a story of 30 bytes, not json\n")
    repl, out, _ = drive(loaded, [f"/save {story}", "/bye"])
    assert story.read_text() == "a story of 30 bytes, not json\n"
    assert "exists" in out and "--force" in out and "Traceback" not in out


def test_save_force_replaces_and_a_second_save_of_the_session_replaces_its_own(loaded, tmp_path):
    target = tmp_path / "conv.json"
    target.write_text("old")
    repl, out, _ = drive(loaded, ["hello", f"/save {target} --force", "again", f"/save {target}", "/bye"])
    import json

    assert len(json.loads(target.read_text())["messages"]) == 4, out


def test_save_makes_no_folders(loaded, tmp_path):
    missing = tmp_path / "nonexistent" / "dir" / "x.json"
    repl, out, _ = drive(loaded, ["hello", f"/save {missing}", "/bye"])
    assert not (tmp_path / "nonexistent").exists()
    assert "does not exist" in out and "Traceback" not in out


# -- item 2: story --out ----------------------------------------------------------------------------
class Loaded(Exception):
    """The loader was reached: every check before it passed."""


@pytest.fixture
def h2ochat_main(monkeypatch, capsys):
    from conftest import replace_loader

    def refuse(*args, **kwargs):
        raise Loaded

    replace_loader(monkeypatch, refuse)

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["h2ochat", *args])
        with pytest.raises(SystemExit) as exited:
            main()
        return subprocess.CompletedProcess(args, exited.value.code, "", capsys.readouterr().err)

    return run


def test_story_out_refuses_an_existing_story(h2ochat_main, tmp_path):
    story = tmp_path / "story.txt"
    story.write_text("x" * 5763)
    result = h2ochat_main("story", "--out", str(story), "-n", "1",
                          "--tokens", "2")
    assert result.returncode == 2 and story.stat().st_size == 5763, result.stderr
    assert "exists" in result.stderr and "--force" in result.stderr and "Traceback" not in result.stderr


def test_story_out_refuses_each_numbered_file(h2ochat_main, tmp_path):
    (tmp_path / "s-2.txt").write_text("second")
    result = h2ochat_main("story", "--out", str(tmp_path / "s.txt"),
                          "-n", "2", "--tokens", "2")
    assert result.returncode == 2 and "s-2.txt" in result.stderr and (tmp_path / "s-2.txt").read_text() == "second"


def test_eval_plot_refuses_an_existing_file_and_a_missing_folder(h2ochat_main, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    plot = tmp_path / "p.png"
    plot.write_bytes(b"png")
    result = h2ochat_main("eval", "--text", str(text), "--plot", str(plot))
    assert result.returncode == 2 and plot.read_bytes() == b"png" and "--force" in result.stderr, result.stderr
    result = h2ochat_main("eval", "--text", str(text),
                          "--plot", str(tmp_path / "new" / "p.png"))
    assert result.returncode == 2 and not (tmp_path / "new").exists(), result.stderr


def test_a_piped_line_with_a_stray_byte_is_one_error_and_the_chat_goes_on(loaded):
    repl, output, code = piped(loaded, "hello \udcff there\nhi\n")  # (stdin decoded with surrogateescape)
    assert code == 0 and "this line is not UTF-8 text: byte 0xff" in output() and "Traceback" not in output()
    assert [m["content"] for m in repl.conv.messages if m["role"] == "user"] == ["hi"]


def test_eval_output_makes_no_folders(h2ochat_main, tmp_path):
    result = h2ochat_main("eval", "--task", "ruler", "--output", str(tmp_path / "new" / "log.jsonl"))
    assert result.returncode == 2 and "does not exist" in result.stderr and not (tmp_path / "new").exists()
