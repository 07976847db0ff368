"""Kept conversations: the store on disk, `h2ochat history`, and resuming with `run --continue`."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from h2ochat.chat import history
from h2ochat.cli import app

runner = CliRunner()


def conversation(messages, **settings) -> dict:
    return {"format": "h2ochat-conversation", "version": 1, "settings": settings,
            "messages": [{"role": role, "content": text} for role, text in messages]}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("H2OCHAT_HOME", str(tmp_path))
    return tmp_path


def test_the_home_is_the_one_the_up_arrow_history_uses(home, monkeypatch):
    from h2ochat.chat.repl import history_path

    assert history.conversations_dir() == home / "conversations" and history_path() == home / "history"
    monkeypatch.delenv("H2OCHAT_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "xdg"))
    assert history.conversations_dir() == home / "xdg" / "h2ochat" / "conversations"


def test_an_interrupted_write_leaves_the_old_file_whole(home, monkeypatch):
    path = home / "c.json"
    history.write_atomic(path, conversation([("user", "first")]))
    before = path.read_bytes()

    def failing_dump(data, file, **kwargs):
        file.write('{"format": "h2ochat-conv')  # half written, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(history.json, "dump", failing_dump)
    with pytest.raises(KeyboardInterrupt):
        history.write_atomic(path, conversation([("user", "second")]))
    assert path.read_bytes() == before
    assert [p.name for p in home.iterdir()] == ["c.json"]


def test_history_lists_date_model_turns_and_first_line_newest_first(home):
    folder = history.conversations_dir()
    older = history.ConversationLog("opt-125m", folder, id="20240101-000000-aaaa")
    older.save(conversation([("user", "old question"), ("assistant", "old answer")]))
    newer = history.ConversationLog("smollm2-135m", folder, id="20240202-000000-bbbb")
    newer.save(conversation([("user", "\n  what is a heavy hitter?\nsecond line"), ("assistant", "a token"),
                             ("user", "thanks"), ("assistant", "welcome")]))
    # the order by modification time, set rather than waited for (a sleep can fall within the clock's step)
    older_file = next(folder.glob("20240101-000000-aaaa*.json"))
    stamp = older_file.stat().st_mtime
    os.utime(older_file, (stamp - 60, stamp - 60))
    (folder / "20240303-000000-cccc.json").write_text("not json")
    os.utime(folder / "20240303-000000-cccc.json", (0, 0))  # the oldest file
    result = runner.invoke(app, ["history"])
    assert result.exit_code == 0, result.output
    rows = [line.split("\t") for line in result.output.strip().splitlines()]
    assert [row[0] for row in rows] == ["20240202-000000-bbbb", "20240101-000000-aaaa", "20240303-000000-cccc"]
    assert rows[0][2:] == ["smollm2-135m", "2", "what is a heavy hitter?"]
    assert rows[1][2:] == ["opt-125m", "1", "old question"]
    assert rows[2][4].startswith("unreadable:") and "not valid JSON" in rows[2][4]
    listed = json.loads(runner.invoke(app, ["history", "--json", "--limit", "1"]).output)
    assert [e["id"] for e in listed] == ["20240202-000000-bbbb"] and listed[0]["turns"] == 2


@pytest.mark.parametrize("args", [["run", "--conversation", "20240303"], ["run", "--continue"],
                                  ["history", "20240303-000000-cccc"]])
def test_a_corrupt_conversation_is_one_line_and_left_alone(home, args):
    folder = history.conversations_dir()
    folder.mkdir(parents=True)
    spoiled = folder / "20240303-000000-cccc.json"
    spoiled.write_bytes(b'{"format": "h2ochat-conversation", "messages": [')
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("h2ochat: error:") and "20240303-000000-cccc" in lines[0]
    assert spoiled.read_bytes() == b'{"format": "h2ochat-conversation", "messages": ['


def test_unknown_or_ambiguous_ids_are_refused(home):
    folder = history.conversations_dir()
    for name in ("20240101-000000-aaaa", "20240101-000000-aaab"):
        history.ConversationLog("m", folder, id=name).save(conversation([("user", "hi")]))
    assert history.find("20240101-000000-aaab").stem == "20240101-000000-aaab"
    with pytest.raises(history.ConversationFileError, match="matches 2"):
        history.find("20240101")
    with pytest.raises(history.ConversationFileError, match="no conversation"):
        history.find("1999")


def test_run_continue_resumes_the_last_conversation_with_its_model_and_settings(home, tiny_checkpoint):
    env = {"NO_COLOR": "1"}
    first = runner.invoke(app, ["run", "--model", str(tiny_checkpoint), "--budget", "24", "--temperature", "0",
                                "--max-new-tokens", "3", "--top-k", "7"], input="hello there\n/bye\n", env=env)
    assert first.exit_code == 0, first.output
    (path,) = history.conversations_dir().glob("*.json")
    stored = json.loads(path.read_text())
    assert stored["model"] == str(tiny_checkpoint.resolve()) and len(stored["messages"]) == 2
    # no --model: the conversation's own; --max-new-tokens given: it wins, the rest is as stored
    second = runner.invoke(app, ["run", "--continue", "--max-new-tokens", "2"], input="and then?\n/bye\n", env=env)
    assert second.exit_code == 0, second.output
    assert f"resumed conversation {path.stem}" in second.output and "1 turns" in second.output
    assert list(history.conversations_dir().glob("*.json")) == [path]  # the same conversation goes on
    resumed = json.loads(path.read_text())
    assert resumed["messages"][:2] == stored["messages"]
    assert [m["role"] for m in resumed["messages"]] == ["user", "assistant", "user", "assistant"]
    settings = resumed["settings"]
    assert (settings["top_k"], settings["temperature"], settings["max_new_tokens"]) == (7, 0.0, 2)
    assert settings["cache"]["budget"] == "24"


def test_no_history_keeps_nothing(home, tiny_checkpoint):
    result = runner.invoke(app, ["run", "--model", str(tiny_checkpoint), "--max-new-tokens", "2", "--no-history"],
                           input="hello\n/bye\n", env={"NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert not history.conversations_dir().exists()


# -- two sessions on one conversation (issue 15, item 3) ----------------------------------------------
def resumed_twice(home):
    path = history.conversations_dir() / "20240101-000000-abcd.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**conversation([("user", "first"), ("assistant", "one")]), "id": path.stem}))
    first, _ = history.ConversationLog.resume(path, "tiny")
    second, _ = history.ConversationLog.resume(path, "tiny")
    return path, first, second


def test_two_sessions_on_one_conversation_keep_both_sets_of_turns(home):
    """`run --continue` in two terminals: the second writer finds the file changed under it and goes
    on as a new conversation with a notice, instead of erasing the first writer's turns."""
    path, first, second = resumed_twice(home)
    mine = conversation([("user", "first"), ("assistant", "one"), ("user", "from terminal A"), ("assistant", "a")])
    theirs = conversation([("user", "first"), ("assistant", "one"), ("user", "from terminal B"), ("assistant", "b")])
    assert first.save(mine) is None
    notice = second.save(theirs)
    assert notice and "changed by another session" in notice and second.id in notice
    assert second.path != path
    assert json.loads(path.read_text())["messages"] == mine["messages"]
    assert json.loads(second.path.read_text())["messages"] == theirs["messages"]
    # each goes on in its own file from now on
    assert first.save({**mine, "messages": mine["messages"] + [{"role": "user", "content": "A again"}]}) is None
    assert second.save(theirs) is None and json.loads(path.read_text())["messages"][-1]["content"] == "A again"


def test_a_write_waits_for_the_conversations_lock(home):
    """The check and the write happen under the conversation's lock: while another session holds it,
    nothing is written (here the wait runs out: a one-line OSError the REPL reports)."""
    from filelock import FileLock, Timeout

    path, first, _ = resumed_twice(home)
    first.lock_timeout = 0.05
    before = path.read_text()
    with FileLock(str(path.parent / f".{path.name}.lock")):
        with pytest.raises(Timeout):
            first.save(conversation([("user", "first"), ("assistant", "one"), ("user", "blocked")]))
    assert path.read_text() == before and isinstance(Timeout(str(path)), OSError)
    assert first.save(conversation([("user", "first"), ("assistant", "one"), ("user", "later")])) is None
