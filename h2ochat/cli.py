"""The `h2ochat` command: sub-commands live in h2ochat/commands/, one module each.

A sub-command's module is imported only when that command runs (or shows its own help): `h2ochat
--help`, a typo in a command name or `h2ochat history` never import torch or transformers, which take
seconds. The command list reads each command's summary from its module's source (its docstring).
"""

from __future__ import annotations

import ast
import errno
import importlib
import importlib.util
import os
import sys

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.24 vendors click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors

from .errors import EXIT_INTERRUPTED, EXIT_USAGE, UserError

# command name -> module in h2ochat/commands/, in the order --help lists them
COMMANDS = {"generate": "generate", "eval": "eval", "bench": "bench", "run": "run", "story": "story",
            "history": "history", "models": "list_models", "serve": "serve"}
# the commands that load a model: they take --threads (options.takes_threads)
MODEL_COMMANDS = ("generate", "eval", "bench", "run", "story", "serve")


def command_summary(name: str) -> str:
    """The first paragraph of the docstring of the function ``register`` hands to
    ``app.command(name)``, read from the module's source without importing it."""
    spec = importlib.util.find_spec(f"{__package__}.commands.{COMMANDS[name]}")
    tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for node in ast.walk(functions["register"]):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Call) and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id in functions:
            doc = ast.get_docstring(functions[node.args[0].id]) or ""
            return " ".join(doc.split("\n\n")[0].split())  # its first paragraph, on one line
    return ""


def build_command(name: str) -> TyperCommand:
    """The click command of one sub-command (its module imported now)."""
    from . import options

    module = importlib.import_module(f"{__package__}.commands.{COMMANDS[name]}")
    single = typer.Typer(pretty_exceptions_enable=False)
    module.register(single)
    if name in MODEL_COMMANDS:
        for info in single.registered_commands:
            info.callback = options.takes_threads(info.callback)
    command = typer.main.get_command(single)
    command.name = name
    return command


class LazyGroup(TyperGroup):
    """The root command: sub-commands are built on first use; the command list of --help is built
    from summaries alone."""

    def __init__(self, **attrs):
        super().__init__(**attrs)
        self.commands = dict.fromkeys(COMMANDS)  # names for typo suggestions ("Did you mean ...")
        self._built: dict[str, TyperCommand] = {}
        self._listing = False

    def list_commands(self, ctx) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx, cmd_name: str):
        if cmd_name not in COMMANDS:
            return None
        if self._listing:  # the help's command list: a name and a summary are enough
            return TyperCommand(cmd_name, help=command_summary(cmd_name))
        if cmd_name not in self._built:
            self._built[cmd_name] = build_command(cmd_name)
        return self._built[cmd_name]

    def format_help(self, ctx, formatter) -> None:
        self._listing = True
        try:
            return super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    name="h2ochat",
    cls=LazyGroup,
    help="Chat and long-form generation in a fixed KV-cache budget (H2O heavy-hitter cache).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def installed_version() -> str:
    """The version the package was installed at (pyproject.toml's), from its metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("h2ochat")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        print(f"h2ochat {installed_version()}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Chat and long-form generation in a fixed KV-cache budget (H2O heavy-hitter cache)."""


OUTPUT_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write that fails because the output is full


def check_arguments(arguments: list[str]) -> None:
    """Every argument that is not an existing path must be UTF-8 text: one that is not (a prompt
    with a stray byte) would reach the tokenizer and fail there, after the model has loaded."""
    from .chat.prompting import typed_text

    for position, argument in enumerate(arguments, 1):
        if argument.isascii() or os.path.exists(argument):  # (a file name may be any bytes)
            continue
        shown = argument.encode("utf-8", "surrogateescape").decode("utf-8", "replace") \
            if all(not 0xD800 <= ord(c) <= 0xDC7F for c in argument) else argument.encode("utf-8", "replace").decode()
        typed_text(argument, f"argument {position} ({shown[:40]!r})")


def main() -> None:
    """Console entry point: usage errors are one line and exit 2, Ctrl-C exits 130."""
    try:
        check_arguments(sys.argv[1:])
    except UserError as exc:
        print(f"h2ochat: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    from .loading.cache_dirs import persistent_compile_cache

    persistent_compile_cache()  # (before torch._dynamo is imported: it fixes inductor's folder then)
    try:
        code = app(standalone_mode=False)
    except click_errors.UsageError as exc:
        if not exc.format_message():  # bare `h2ochat`: the help was printed, but no command ran
            sys.exit(EXIT_USAGE)
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
    except OSError as exc:
        if exc.errno not in OUTPUT_FULL:
            raise
        # standard output cannot take more (`> /dev/full`, a full disk or quota): what was written
        # stays written; the rest is said in one line, and Python's own flush at exit finds nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"h2ochat: error: could not write the output: {exc.strerror}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
