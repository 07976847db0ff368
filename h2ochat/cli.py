"""The `h2ochat` command: sub-commands live in h2ochat/commands/, one module each."""

from __future__ import annotations

import os
import sys

import typer

try:  # typer >= 0.24 vendors click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors

from .commands import bench, eval, generate, history, list_models, run, serve, story
from .errors import EXIT_INTERRUPTED, EXIT_USAGE

app = typer.Typer(
    name="h2ochat",
    help="Chat and long-form generation in a fixed KV-cache budget (H2O heavy-hitter cache).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root() -> None:
    """Chat and long-form generation in a fixed KV-cache budget (H2O heavy-hitter cache)."""


for command_module in (generate, eval, bench, run, story, history, list_models, serve):
    command_module.register(app)


def main() -> None:
    """Console entry point: usage errors are one line and exit 2, Ctrl-C exits 130."""
    try:
        code = app(standalone_mode=False)
    except click_errors.UsageError as exc:
        if not exc.format_message():  # bare `h2ochat`: the help was printed
            sys.exit(0)
        hint = f" (see `h2ochat {exc.ctx.command.name} --help`)" if exc.ctx and exc.ctx.command.name != "h2ochat" else ""
        print(f"h2ochat: error: {exc.format_message()}{hint}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("\ninterrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:  # `h2ochat ... | head`: the reader left, nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
