"""Labels that come from data print as they are (issue 31, item 4): `h2o [int8]` in a text table is
not Rich markup. Before, eval's table showed two rows both named `h2o` and the pass-key table `h2o 12`
twice, while the JSON said `h2o [int8]`: every console is made by ui.make_console, which reads no
markup, and the labels are checked against the JSON records of the same run.
"""

from __future__ import annotations

import io
import json

from typer.testing import CliRunner

import pytest

from h2ochat.cli import app
from h2ochat.console import make_console


def invoke(*args) -> tuple[int, str, str]:
    result = CliRunner(env={"COLUMNS": "300"}).invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_a_console_prints_brackets_as_they_are():
    out = io.StringIO()
    make_console(file=out).print("h2o [int8] · [bold]not a style[/] · [/]")
    assert out.getvalue().strip() == "h2o [int8] · [bold]not a style[/] · [/]"


def table_rows(text: str) -> list[str]:
    """The first cell of each body row of a Rich table printed as text."""
    return [line.strip("│┃ ").split("│")[0].strip() for line in text.splitlines() if line.startswith("│")]


def test_eval_table_names_each_slot_format_as_the_json_does(tiny_checkpoint, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = ("eval", "--text", str(text), "--model", str(tiny_checkpoint), "--tokens", "40", "--policies", "full,h2o",
            "--budget", "8", "--kv-dtype", "auto,int8")
    code, out, err = invoke(*args, "--json")
    assert code == 0, err
    names = list(dict.fromkeys(r["policy"] for r in json.loads(out)["results"]))
    assert "h2o [int8]" in names
    code, out, err = invoke(*args)
    assert code == 0, err
    first_table = out.split("Perplexity of the predictions")[0]
    assert table_rows(first_table) == names


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    from checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama-512"), "llama", max_position_embeddings=512)


def test_passkey_table_names_each_slot_format_as_the_json_does(long_checkpoint, tmp_path):
    filler = tmp_path / "filler.txt"
    filler.write_text("The grass is green. The sky is blue. The sun is yellow. " * 60)
    args = ("eval", "--task", "passkey", "--model", str(long_checkpoint), "--text", str(filler), "--lengths", "4x",
            "--depths", "0.5", "--keys", "1", "--budget", "12", "--policies", "full,h2o", "--kv-dtype", "auto,int8")
    code, out, err = invoke(*args, "--json")
    assert code == 0, err
    names = list(dict.fromkeys(r["row"] for r in json.loads(out)["results"]))
    assert "h2o 12 [int8]" in names
    code, out, err = invoke(*args)
    assert code == 0, err
    assert table_rows(out) == names
