"""The story's files: where N stories go (``output_paths``), an output refused before the model loads
when it cannot be written (``check_writable``), a story read exactly as its file holds it
(``read_story``), and ``--continue``'s file opened for appending under a lock (``appending``), so
its bytes are never rewritten and two runs cannot interleave."""

from __future__ import annotations

import errno
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError


def output_paths(out: Path, count: int) -> list[Path]:
    """``story.txt`` for one story; ``story-1.txt`` ... ``story-N.txt`` for N."""
    if count == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{k}{out.suffix}") for k in range(1, count + 1)]


def check_writable(path: Path) -> None:
    """Refuse an output path that cannot be written before the model loads (minutes, on a big one)."""
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", str(path))
    parent = path.parent
    if not parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such directory", str(parent))
    # open it for appending, as writing will: permission bits alone say yes to root on /sys or /proc,
    # or on a read-only mount (an existing file is not changed; a new one is removed again)
    existed = path.exists()
    try:
        with path.open("ab"):
            pass
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink(missing_ok=True)


def read_story(path: Path) -> str:
    """The text of a story to continue, exactly as it is in the file."""
    if not path.is_file():
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text") from None


@contextmanager
def appending(path: Path):
    """The story file open for appending (never truncated, never rewritten), under an exclusive lock
    on the file itself, so two `story --continue` runs cannot interleave their text. Yields the
    binary file."""
    with path.open("ab") as file:
        try:
            import fcntl
        except ImportError:  # pragma: no cover  (Windows: no advisory locks; appending still cuts nothing)
            yield file
            return
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{path} is being written by another h2ochat story; try again when it is done") from None
        try:
            yield file
        finally:
            file.flush()
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)
