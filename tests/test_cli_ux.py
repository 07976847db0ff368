"""Behaving like a good CLI: grouped help, one-line errors, plain output in pipes, piped chat."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from h2ochat.cli import app

ANSI = re.compile(r"\x1b\[")
runner = CliRunner()


@pytest.mark.parametrize("command", ["run", "story"])
def test_help_is_grouped(command):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    for panel in ("Model", "Cache", "Sampling"):
        assert f"─ {panel} " in result.output
    assert "H2OCHAT_MODEL" in result.output


def test_models_lists_aliases_plainly_when_piped():
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    assert not ANSI.search(result.output) and "┃" not in result.output
    line = next(line for line in result.output.splitlines() if line.startswith("opt-125m"))
    assert "opt" in line and "facebook/opt-125m" in line


def test_models_json_has_every_alias():
    from h2ochat.loading.sources import ALIASES

    rows = json.loads(runner.invoke(app, ["models", "--json"]).output)
    assert {row["alias"] for row in rows} == set(ALIASES)


@pytest.mark.parametrize("args, message", [
    (["run", "--budget", "lots"], "--budget"),
    (["run", "--policy", "lru"], "unknown policy"),
    (["run", "--temperature", "0", "--top-p", "2"], "top_p"),
    (["story", "--prompt-file", "/nonexistent/opening.txt"], "opening.txt"),
    (["run", "--model", "no-such-model-alias"], "unknown model"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("h2ochat: error:") and message in lines[0]


def test_piped_chat_is_plain_text(tiny_checkpoint, tmp_path):
    env = {**os.environ, "NO_COLOR": "1", "H2OCHAT_HOME": str(tmp_path), "H2OCHAT_MODEL": str(tiny_checkpoint)}
    done = subprocess.run([sys.executable, "-m", "h2ochat.cli", "run", "--max-new-tokens", "4", "--budget", "12"],
                          input="hello\n/cache\n/bye\n", capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "prompt tok" in done.stdout and "KV cache" in done.stdout
    assert not ANSI.search(done.stdout) and not ANSI.search(done.stderr)
    assert "Traceback" not in done.stderr


def test_generate_stops_at_an_end_of_turn_marker_as_run_does(tiny_checkpoint, monkeypatch):
    """One stop rule for generate, run and story: <|end|> (not the tokenizer's eos) ends generation."""
    import torch
    from transformers import AutoTokenizer

    import h2ochat.engine.generation as generation

    end = AutoTokenizer.from_pretrained(str(tiny_checkpoint)).convert_tokens_to_ids("<|end|>")
    calls = []

    def scripted(logits, sampling, generator=None, seen=None):
        calls.append(1)
        return torch.full((logits.shape[0],), end if len(calls) == 4 else 50)

    monkeypatch.setattr(generation, "sample", scripted)
    result = runner.invoke(app, ["generate", "hi", "--model", str(tiny_checkpoint), "-n", "20", "--raw", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["generated_tokens"] == 4  # three tokens, then the marker
