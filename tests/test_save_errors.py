"""Writes that fail name what the user wrote and why (issue 31, items 5 and 8): `/save DIR`,
`/save /proc/conv.json` and a full disk said the temporary file the write went through. Now one line
names the path as given and the system's reason, the session goes on with the conversation intact,
nothing is left behind, and a path that is not a regular file (a FIFO, a device) is never replaced."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from h2ochat.chat import history
from h2ochat.errors import one_line
from h2ochat.chat.history import WriteError, write_atomic

from test_repl import drive, loaded  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("seed")


def save_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("error:"))


def test_save_to_a_directory_names_it(loaded, tmp_path):  # noqa: F811
    repl, out, code = drive(loaded, ["hello", f"/save {tmp_path}", "/bye"])
    assert code == 0 and len(repl.conv.messages) == 2  # the session and the conversation go on
    assert save_line(out) == f"error: cannot write {tmp_path}: it is a directory; give a file name"
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")
def test_save_where_nothing_can_be_written_names_the_path(loaded):  # noqa: F811
    repl, out, code = drive(loaded, ["hello", "/save /proc/conv.json", "/bye"])
    line = save_line(out)
    assert line.startswith("error: cannot write /proc/conv.json: ") and ".tmp" not in line
    assert code == 0 and len(repl.conv.messages) == 2


def test_a_fifo_is_not_replaced_by_a_file(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(WriteError) as failed:
        write_atomic(fifo, {"messages": []})
    assert one_line(failed.value) == f"cannot write {fifo}: not a regular file"
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(tmp_path.iterdir()) == [fifo]


def test_a_write_that_fails_late_names_the_path_and_leaves_nothing(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(history.json, "dump", full_disk)
    target = tmp_path / "conv.json"
    with pytest.raises(WriteError) as failed:
        write_atomic(target, {"messages": []})
    assert one_line(failed.value) == f"cannot write {target}: No space left on device"
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    write_atomic(target, {"messages": []})
    assert json.loads(target.read_text()) == {"messages": []}
