"""Turning failures the user can fix into one line on stderr and exit code 2 (130 for Ctrl-C).

A user mistake (a bad option, a missing file, a budget the model cannot hold) is a ``UserError``
(or one of the few library errors listed in ``USER_ERRORS``): one line, no traceback. Anything
else is a bug and keeps its traceback, so it gets reported and fixed instead of read as the
user's fault. ``H2OCHAT_DEBUG=1`` shows the traceback of user errors too.
"""

from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager

import typer

from .loading.sources import ModelError  # sources.py imports nothing heavy at import time


class UserError(ValueError):
    """Bad input the user can fix: reported in one line. (A ValueError, so code that validates
    with ``except ValueError`` keeps working.)"""


USER_ERRORS = (UserError, ModelError, FileNotFoundError, IsADirectoryError, PermissionError, UnicodeDecodeError,
               MemoryError)
# commands whose checks still raise plain ValueError for bad input (eval, bench) keep this wider net
LEGACY_USER_ERRORS = USER_ERRORS + (ValueError,)


def position_limit_error() -> tuple[type[BaseException], ...]:
    """The cache's PositionLimitError, when the cache module is loaded at all (only then can it have
    been raised): importing it here would import torch with every command, --help included."""
    module = sys.modules.get(f"{__package__}.kv")
    return (module.PositionLimitError,) if module is not None and hasattr(module, "PositionLimitError") else ()


EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def debugging() -> bool:
    """H2OCHAT_DEBUG=1: every error with its traceback."""
    return os.environ.get("H2OCHAT_DEBUG", "").strip() not in ("", "0")


@contextmanager
def user_input():
    """Inside: a ValueError comes from checking what the user typed (an option, a /command), so it
    is a UserError. Keep it around the parsing and validation only, never around a computation."""
    try:
        yield
    except UserError:
        raise
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def fail(message: str, code: int = EXIT_USAGE) -> "typer.Exit":
    print(f"h2ochat: error: {message}", file=sys.stderr)
    return typer.Exit(code)


def one_line(exc: BaseException) -> str:
    if isinstance(exc, MemoryError):
        return "out of memory: try a smaller model, a smaller --budget or a smaller batch"
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, PermissionError)) and exc.filename:
        return f"{exc.strerror or 'cannot open'}: {exc.filename}"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _one_line_errors(command, expected: tuple[type[BaseException], ...]):
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except Exception as exc:
            if not isinstance(exc, expected + position_limit_error()):
                raise
            if debugging():
                raise
            raise fail(one_line(exc)) from None
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper


def strict_user_errors(command):
    """Decorator for a command: user errors become one line and exit 2, Ctrl-C exits 130, anything
    else (a bug) goes on with its traceback."""
    return _one_line_errors(command, USER_ERRORS)


def user_errors(command):
    """As ``strict_user_errors``, but every ValueError counts as the user's: for the commands (eval,
    bench) whose checks have not moved to UserError yet."""
    return _one_line_errors(command, LEGACY_USER_ERRORS)
