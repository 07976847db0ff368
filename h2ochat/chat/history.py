"""Conversations kept under the h2ochat home: one JSON file each, rewritten atomically after every turn.

The home is ``$H2OCHAT_HOME``, else ``$XDG_DATA_HOME/h2ochat``, else ``~/.local/share/h2ochat``
(the up-arrow history lives there too). A conversation file is what ``/save`` writes (format,
settings, messages) plus its id, the model and two timestamps, so ``/load`` reads either.

Writes go to a temporary file in the same folder, then ``os.replace``: a reader (or a crash) sees
the old file or the new one, never half of one. A file that cannot be read is reported in one line
and never written over: the session goes on under a new id. Two sessions on one conversation
(``run --continue`` in two terminals) take the conversation's lock (a hidden ``.ID.json.lock``
beside it) around each check-and-write; the one that finds the file changed by the other goes on
as a new conversation (a fork, with a notice) instead of writing the other's turns away.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from ..errors import UserError

FORMAT = "h2ochat-conversation"
LOCK_TIMEOUT_S = 10.0  # another session holds a conversation's lock only while it writes the file


def home() -> Path:
    """The h2ochat data folder: $H2OCHAT_HOME, else $XDG_DATA_HOME/h2ochat, else ~/.local/share/h2ochat."""
    explicit = os.environ.get("H2OCHAT_HOME")
    if explicit:
        return Path(explicit)
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "h2ochat"


def conversations_dir() -> Path:
    return home() / "conversations"


class ConversationFileError(UserError):
    """A stored conversation that cannot be read (one line, for the user)."""


def new_id(now: float | None = None) -> str:
    """Sortable by time, unique enough for one person: 20250301-142233-7f3a."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return f"{stamp}-{secrets.token_hex(2)}"


def refuse_replacing(path: Path, how: str) -> None:
    """A UserError when ``path`` holds a file (or anything) already: a write meant for a new file must
    not replace a user's work unnoticed. ``how``: what to do to replace it all the same."""
    if path.is_file():  # (a folder, a device or a pipe: the write itself says why it cannot be one)
        raise UserError(f"{path} exists ({path.stat().st_size:,} bytes) and was not replaced: {how}")


class WriteError(OSError):
    """A file that could not be written, named as the user gave it (not the temporary file the write
    went through), with the system's reason: ``cannot write /proc/conv.json: Permission denied``."""

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"


def write_atomic(path: Path, data: dict) -> None:
    """Write JSON to ``path`` through a temporary file and os.replace (never a half-written file).
    Any failure is a WriteError naming ``path``. No folder is made: a path whose folder is missing
    is more likely a typo than a wish for new folders (the caller makes its own folders)."""
    temporary = None
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "it is a directory; give a file name", str(path))
        if path.exists() and not path.is_file():  # os.replace would put a file where a device was
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if not path.parent.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"the folder {path.parent} does not exist (h2ochat makes no "
                                    "folders it was not asked for: make it first)", str(path))
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(data, file, indent=1, ensure_ascii=False)
            file.write("\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as exc:
        if temporary is not None:
            try:
                os.unlink(temporary)
            except FileNotFoundError:
                pass
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise WriteError(exc.errno, exc.strerror or str(exc), str(path)) from None
        raise


def read_conversation(path: Path) -> dict:
    """A stored (or /save'd) conversation, checked; ConversationFileError in one line otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversationFileError(f"no conversation file {path}") from None
    except OSError as exc:
        raise ConversationFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConversationFileError(f"{path} is not UTF-8 text; it is left as it is") from None
    except json.JSONDecodeError as exc:
        raise ConversationFileError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno}); "
                                    "it is left as it is") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConversationFileError(f"{path} is not an h2ochat conversation; it is left as it is")
    messages = data.get("messages")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ConversationFileError(f"{path} has no valid message list; it is left as it is")
    return data


@dataclass
class Entry:
    """One stored conversation, for `h2ochat history` and for resuming."""

    id: str
    path: Path
    updated: float  # seconds since the epoch
    model: str = ""
    turns: int = 0
    first_line: str = ""
    error: str | None = None  # why it cannot be read

    def to_json(self) -> dict:
        return {"id": self.id, "path": str(self.path), "updated": time.strftime("%Y-%m-%dT%H:%M:%S",
                                                                                 time.localtime(self.updated)),
                "model": self.model, "turns": self.turns, "first_line": self.first_line, "error": self.error}


def entry(path: Path) -> Entry:
    try:
        modified = path.stat().st_mtime
    except OSError:
        modified = 0.0
    try:
        data = read_conversation(path)
    except ConversationFileError as exc:
        return Entry(path.stem, path, modified, error=str(exc))
    messages = data["messages"]
    first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
    first_line = next((line.strip() for line in first_user.splitlines() if line.strip()), "")
    return Entry(str(data.get("id") or path.stem), path, float(data.get("updated") or modified),
                 str(data.get("model") or ""), sum(m["role"] == "user" for m in messages), first_line)


def entries(folder: Path | None = None) -> list[Entry]:
    """Every stored conversation, the most recently updated first."""
    folder = folder or conversations_dir()
    if not folder.is_dir():
        return []
    found = [entry(path) for path in folder.glob("*.json") if not path.name.startswith(".")]
    return sorted(found, key=lambda e: (e.updated, e.id), reverse=True)


def find(wanted: str | None, folder: Path | None = None) -> Path:
    """The file of conversation ``wanted`` (an id or a unique start of one), or of the most recent
    one when ``wanted`` is None."""
    folder = folder or conversations_dir()
    if wanted is None:
        latest = entries(folder)
        if not latest:
            raise ConversationFileError(f"no stored conversation yet (in {folder})")
        if latest[0].error:
            raise ConversationFileError(f"the latest conversation cannot be read: {latest[0].error} "
                                        "(`h2ochat history` lists the others: --conversation ID)")
        return latest[0].path
    exact = folder / f"{wanted}.json"
    if exact.is_file():
        return exact
    matches = sorted(folder.glob(f"{wanted}*.json")) if folder.is_dir() and "/" not in wanted else []
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ConversationFileError(f"no conversation {wanted!r} (`h2ochat history` lists them)")
    raise ConversationFileError(f"{wanted!r} matches {len(matches)} conversations: "
                                + ", ".join(p.stem for p in matches[:4]) + ("…" if len(matches) > 4 else ""))


class ConversationLog:
    """Where a REPL session keeps its conversation: rewritten after every turn and settings change.

    Nothing is written until the conversation has a message. Before replacing its file, under the
    conversation's lock, the log checks the file is still the one it read or wrote; if anything else
    changed it (another session on the same conversation, an editor, a crash), the log moves to a
    new id instead of writing over it.
    """

    def __init__(self, model: str, folder: Path | None = None, id: str | None = None, created: float | None = None,
                 lock_timeout: float = LOCK_TIMEOUT_S):
        self.folder = folder or conversations_dir()
        self.model = model
        self.id = id or new_id()
        self.created = created if created is not None else time.time()
        self.lock_timeout = lock_timeout
        self._written: tuple[int, int, int] | None = None  # (inode, mtime_ns, size) of our last write

    def for_model(self, model: str) -> None:
        """The model the conversation goes on with (a resumed one may change it)."""
        self.model = model

    @classmethod
    def resume(cls, path: Path, model: str) -> tuple["ConversationLog", dict]:
        log = cls(model, path.parent, path.stem)
        with log.lock():  # the file as one writer left it, and the signature of that very file
            data = read_conversation(path)
            log._written = log._signature()
        log.created = float(data.get("created") or time.time())
        return log, data

    def lock(self) -> FileLock:
        """The conversation's lock: held around a check-and-write, never across a turn."""
        return FileLock(self.folder / f".{self.id}.json.lock", timeout=self.lock_timeout)

    @property
    def path(self) -> Path:
        return self.folder / f"{self.id}.json"

    def _signature(self) -> tuple[int, int, int] | None:
        """Which file is there: each write replaces it (a new inode), so a write by anyone else shows."""
        try:
            info = self.path.stat()
        except OSError:
            return None
        return info.st_ino, info.st_mtime_ns, info.st_size

    def start_new(self) -> None:
        """Keep what was written under the old id; go on under a new one."""
        self.id, self.created, self._written = new_id(), time.time(), None

    def save(self, conversation: dict) -> str | None:
        """Write the conversation; returns a notice when it had to move to a new id (its file was
        spoiled, or written by another session since this one read or wrote it)."""
        if not conversation.get("messages"):
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.lock():
            notice = self._fork_if_changed()
            if notice is None:
                self._write(conversation)
                return None
        with self.lock():  # the new id's
            self._write(conversation)
        return notice

    def _fork_if_changed(self) -> str | None:
        """Under the lock: when the file is not the one this log last read or wrote, move to a new id."""
        current = self._signature()
        if current is None or current == self._written:
            return None
        old = self.id
        try:
            read_conversation(self.path)
            why = f"conversation {old} was changed by another session meanwhile (its turns are kept there)"
        except ConversationFileError as exc:
            why = str(exc)
        self.start_new()
        return f"{why}; this one goes on as {self.id}"

    def _write(self, conversation: dict) -> None:
        record = {**conversation, "id": self.id, "model": self.model, "created": self.created, "updated": time.time()}
        write_atomic(self.path, record)
        self._written = self._signature()
