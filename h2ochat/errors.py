"""Turning failures the user can fix into one line on stderr and exit code 2 (130 for Ctrl-C)."""

from __future__ import annotations

import functools
import sys

import typer

from .cache import PositionLimitError
from .models import ModelError

USER_ERRORS = (ModelError, PositionLimitError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError,
               UnicodeDecodeError, MemoryError)
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


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


def user_errors(command):
    """Decorator for a command: known failures become one line and exit 2, Ctrl-C exits 130."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as exc:
            raise fail(one_line(exc)) from None
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper
