"""The command line as a newcomer meets it: help that answers at once, a bare `h2ochat` that is not
a success, `models --json` as its help says, and an empty served model name refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from h2ochat.cli import app, main

runner = CliRunner()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval", "bench", "story", "run", "generate", "serve", "models", "history"])
def test_a_commands_help_imports_no_torch(command):
    """What made `eval --help` take seconds where the others answer at once: torch imported to read
    a default. (Counted as modules imported, not as time: no clock decides this test.)"""
    code = ("import sys\nfrom h2ochat.cli import main\nsys.argv = ['h2ochat', %r, '--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('\\nIMPORTED', sorted(m for m in ('torch', 'transformers') if m in sys.modules))") % command
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("IMPORTED []"), done.stdout[-300:]
    assert "Usage" in done.stdout


def test_the_defaults_read_from_source_are_the_modules_own():
    from h2ochat.commands.common import constant_of
    from h2ochat.measure import bench_context, evaluation

    assert constant_of("measure.evaluation", "DEFAULT_BUDGETS") == evaluation.DEFAULT_BUDGETS
    assert constant_of("measure.evaluation", "DEFAULT_POLICIES") == evaluation.DEFAULT_POLICIES
    assert constant_of("measure.evaluation", "MAX_ROWS") == evaluation.MAX_ROWS
    assert constant_of("measure.bench_context", "VARIANTS") == bench_context.VARIANTS
    with pytest.raises(LookupError):
        constant_of("measure.evaluation", "NO_SUCH_NAME")


def test_bare_h2ochat_shows_the_usage_and_is_not_a_success(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["h2ochat"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    assert "Usage" in capsys.readouterr().out


def test_models_json_is_what_its_help_says():
    help_text = " ".join(runner.invoke(app, ["models", "--help"]).output.replace("│", " ").split())
    printed = json.loads(runner.invoke(app, ["models", "--json"]).output)
    assert "one JSON array" in help_text and isinstance(printed, list)
    assert all(isinstance(row, dict) and {"alias", "family", "params_b", "repo", "local", "random_weights",
                                          "default"} <= set(row) for row in printed)


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_served_model_name_is_refused(monkeypatch, capsys, name):
    monkeypatch.setattr(sys, "argv", ["h2ochat", "serve", "--random-weights", "--served-model-name", name,
                                      "--port", "0"])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--served-model-name must not be empty" in err and "Traceback" not in err


@pytest.mark.parametrize("argument", ["Hi \udced\udca0\udc80 there", "lone \ud800 surrogate"])
def test_a_prompt_argument_that_is_not_utf8_is_one_line_before_loading(monkeypatch, capsys, argument):
    """`h2ochat generate $'Hi \\xed\\xa0\\x80 there'`: Python hands the stray bytes over as lone surrogates."""
    from conftest import replace_loader

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    replace_loader(monkeypatch, refuse)
    monkeypatch.setattr(sys, "argv", ["h2ochat", "generate", argument, "-n", "4"])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "argument 2" in err and ("not UTF-8" in err or "not valid Unicode" in err)


def test_a_file_name_that_is_not_utf8_is_still_a_file_name(monkeypatch, tmp_path):
    from h2ochat.cli import check_arguments

    odd = tmp_path / "caf\udce9.txt"  # latin-1 é in a file name
    odd.write_bytes(b"hello")
    check_arguments(["generate", "--prompt-file", str(odd)])
