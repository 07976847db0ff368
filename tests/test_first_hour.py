"""Issue 26, "a newcomer's first hour": each defect as the newcomer met it, at the CLI.

Bad input is one line ``h2ochat: error: ...``, exit 2, no traceback; "before the model loads" is
checked by making the loader fail the test if it is called at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import replace_loader

from h2ochat.loading import gguf_conversion, models
from h2ochat.cli import app

runner = CliRunner()


@pytest.fixture
def no_load(monkeypatch):
    """The model loader fails the test if anything reaches it."""
    def refuse(*args, **kwargs):
        pytest.fail("the model loader was called")
    replace_loader(monkeypatch, refuse)


def one_error_line(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("h2ochat: error:"), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# -- 2: bytes that are not UTF-8 --------------------------------------------------------------------
def test_stdin_that_is_not_utf8_is_refused_before_the_model_loads(no_load):
    result = runner.invoke(app, ["generate", "-", "-n", "3"], input=b"caf\xe9 latte")
    one_error_line(result, "standard input", "0xe9", "offset 3")


def test_prompt_file_that_is_not_utf8_names_the_file(no_load, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf\xe9 latte")
    one_error_line(runner.invoke(app, ["generate", "-f", str(path), "-n", "3"]), str(path), "offset 3")


def test_eval_text_that_is_not_utf8_names_the_file(no_load, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"plain start " * 10 + b"\xff")
    one_error_line(runner.invoke(app, ["eval", "--text", str(path)]), str(path), "0xff", "offset 120")


# -- 10: a typed prompt and --prompt-file -----------------------------------------------------------
def test_a_prompt_and_a_prompt_file_are_refused(no_load, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("Name a colour.")
    one_error_line(runner.invoke(app, ["generate", "List three fruits.", "--prompt-file", str(path)]), "not both")


# -- 9: --no-history with --continue ----------------------------------------------------------------
@pytest.mark.parametrize("resume", [["--continue"], ["--conversation", "2025"]])
def test_no_history_with_a_resumed_conversation_is_a_usage_error(no_load, tmp_path, monkeypatch, resume):
    monkeypatch.setenv("H2OCHAT_HOME", str(tmp_path))
    one_error_line(runner.invoke(app, ["run", "--no-history", *resume]), "--no-history")


# -- 8: recall options while recall is off, recall under the full policy ----------------------------
@pytest.mark.parametrize("args, needle", [
    (["--page", "7", "--selector", "bogus"], "--selector 'bogus'"),
    (["--cold-dtype", "int3"], "--cold-dtype"),
    (["--recall", "32", "--policy", "full"], "--recall needs a policy that evicts"),
])
def test_recall_options_are_checked_with_recall_off(no_load, args, needle):
    one_error_line(runner.invoke(app, ["generate", "hi", *args]), needle)


def test_run_checks_recall_options_before_loading(no_load, tmp_path, monkeypatch):
    monkeypatch.setenv("H2OCHAT_HOME", str(tmp_path))
    one_error_line(runner.invoke(app, ["run", "--selector", "rot9"]), "--selector 'rot9'")


def chat(checkpoint, tmp_path, lines: list[str], *options: str):
    """A piped chat on the tiny model: what the terminal shows."""
    env = {"H2OCHAT_HOME": str(tmp_path), "NO_COLOR": "1"}
    return runner.invoke(app, ["run", "--model", str(checkpoint), "--max-new-tokens", "2", "--no-history", *options],
                         input="\n".join(lines) + "\n", env=env)


def test_set_page_zero_is_one_line_in_the_chat_with_and_without_recall(tiny_checkpoint, tmp_path):
    # 1: with recall, /set page 0 was a ZeroDivisionError traceback from RecallConfig
    result = chat(tiny_checkpoint, tmp_path, ["/set page 0", "/set page -3", "/set page 4"],
                  "--budget", "32", "--recall", "16", "--page", "8")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "ZeroDivisionError" not in result.output
    assert result.output.count("error: --page must be a whole number of tokens >= 1") == 2
    assert "page 4: new cache" in result.output  # a good value still works afterwards
    # 8: without recall the same values were accepted (and re-read the conversation)
    # and a later /set recall failed on them; now the page is still the default 16 and recall turns on
    # (four pages of 8: the last one stages evicted tokens)
    result = chat(tiny_checkpoint, tmp_path, ["/set page 0", "/set page -3", "/set recall 32"], "--budget", "64")
    assert "Traceback" not in result.output
    assert result.output.count("error: --page must be a whole number of tokens >= 1") == 2
    assert "recall 32: new cache" in result.output


def test_set_recall_under_the_full_policy_is_refused_in_the_chat(tiny_checkpoint, tmp_path):
    result = chat(tiny_checkpoint, tmp_path, ["/set recall 32"], "--policy", "full", "--budget", "64")
    assert "Traceback" not in result.output and "error: --recall needs a policy that evicts" in result.output


# -- 11: budgets past the context window, before the weights load -----------------------------------
@pytest.mark.parametrize("budget", ["10000", "99999999999999999999999"])
def test_budget_past_the_window_is_refused_before_the_weights_load(tiny_checkpoint, monkeypatch, budget):
    import transformers

    def no_weights(*args, **kwargs):
        pytest.fail("the weights were loaded")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    result = runner.invoke(app, ["generate", "hi", "--model", str(tiny_checkpoint), "--budget", budget])
    line = one_error_line(result, "64-position context window")
    assert "GiB" not in line  # not the garbled memory figure


def test_budget_past_the_window_is_refused_for_random_weights_too(monkeypatch):
    monkeypatch.setattr(models, "build_random", lambda *a, **k: pytest.fail("the model was built"))
    result = runner.invoke(app, ["generate", "hi", "--model", "smollm2-135m", "--random-weights", "--budget", "10000"])
    one_error_line(result, "8192-position context window")


# -- 5: output paths before the model loads, results kept when an output fails at the end ----------
@pytest.mark.parametrize("task", ["perplexity", "passkey"])
def test_eval_refuses_an_unwritable_plot_before_the_model_loads(no_load, tmp_path, task):
    text = tmp_path / "text.txt"
    text.write_text("some words " * 50)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    folder = tmp_path / "out.png"
    folder.mkdir()
    for plot in (blocker / "x.png", folder):  # under a file (as /sys/x.png: no such place to write); a folder
        one_error_line(runner.invoke(app, ["eval", "--text", str(text), "--task", task, "--plot", str(plot)]), "--plot")


def test_eval_prints_its_results_when_the_plot_fails_at_the_end(tiny_checkpoint, tmp_path, monkeypatch):
    from h2ochat.measure import plotting

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(plotting, "perplexity_plot", full_disk)
    text = tmp_path / "text.txt"
    text.write_text("once upon a time there was a dragon " * 20)
    result = runner.invoke(app, ["eval", "--model", str(tiny_checkpoint), "--text", str(text), "--tokens", "24",
                                 "--budget", "8", "--policies", "full,h2o", "--json", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    report = json.loads(result.stdout)
    assert {r["policy"] for r in report["results"]} >= {"full", "h2o"}
    assert "could not write the plot" in result.stderr and "No space left" in result.stderr


# -- 18: --threads --------------------------------------------------------------------------------
def test_threads_option_is_applied_and_reported(tiny_checkpoint):
    import torch

    before = torch.get_num_threads()
    try:
        result = runner.invoke(app, ["generate", "hi", "--model", str(tiny_checkpoint), "--raw", "-n", "2", "--json",
                                     "--threads", "1"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["threads"] == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", ["generate", "run", "story", "eval", "bench", "serve"])
def test_every_model_command_takes_threads(command):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--threads" in result.output


def test_default_threads_leave_out_the_cores_other_jobs_use(monkeypatch):
    from h2ochat import threads

    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "physical_cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.1, 0.1))
    assert threads.default_threads() == 2  # idle: both cores (prompt reading 145 against 86 tok/s)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.1, 1.0, 0.5))
    assert threads.default_threads() == 1  # one core busy: a second thread would stall every step
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    assert threads.default_threads() == 1
    monkeypatch.setattr(threads, "usable_cpus", lambda: 16)
    monkeypatch.setattr(threads, "physical_cores", lambda: 8)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert threads.default_threads() == 8  # physical cores, not hyper-threads


# -- 19: fast --help, a word from the first second -------------------------------------------------
def test_importing_the_cli_imports_no_torch_or_transformers():
    code = "import sys, h2ochat.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_top_level_help_lists_every_command_without_importing_them():
    code = ("import sys; from h2ochat.cli import main; sys.argv = ['h2ochat', '--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'h2ochat.commands.story') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})
    from h2ochat.cli import COMMANDS

    for name in COMMANDS:
        assert f" {name} " in done.stdout
    assert "HEAVY []" in done.stdout


def test_command_summaries_are_the_commands_docstrings():
    import inspect

    from h2ochat.cli import COMMANDS, build_command, command_summary

    for name in COMMANDS:
        doc = inspect.getdoc(build_command(name).callback)
        assert command_summary(name) == " ".join(doc.split("\n\n")[0].split())


def test_loading_says_what_happens_on_a_terminal(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    from h2ochat.commands.common import loading

    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=200, no_color=True)
    with loading(console, str(tmp_path)):
        pass
    assert f"loading {tmp_path}" in stream.getvalue()
    piped = io.StringIO()
    with loading(Console(file=piped, force_terminal=False), "x"):
        pass
    assert piped.getvalue() == ""


# -- 7: the GGUF conversion's partial folder ---------------------------------------------------------
class _SavingModel:
    """Writes a shard into the folder, then is interrupted (Ctrl-C during "Writing model shards")."""

    hf_quantizer = None

    def __init__(self, interrupt: BaseException):
        self.config, self.interrupt = type("Config", (), {})(), interrupt

    def save_pretrained(self, folder):
        Path(folder).mkdir(parents=True)
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1024)
        raise self.interrupt


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_an_interrupted_conversion_leaves_no_partial_folder(tmp_path, interrupt):
    target = tmp_path / "gguf" / "model-1-2-float32"
    target.parent.mkdir()
    if isinstance(interrupt, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C still stops the program ...
            gguf_conversion.keep_converted(_SavingModel(interrupt), None, target)
    else:  # ... a failed save only costs speed next time
        gguf_conversion.keep_converted(_SavingModel(interrupt), None, target)
    assert list(target.parent.iterdir()) == []


def test_stale_partial_folders_go_a_live_conversion_stays(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"model-1-2-float32.partial-{dead.pid}"
    live = tmp_path / f"model-1-2-float32.partial-{os.getppid()}"  # another process, still running
    done = tmp_path / "model-1-2-float32"
    for folder in (stale, live, done):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    assert gguf_conversion.remove_stale_partials(tmp_path) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, done.name])
    old = os.path.getmtime(live) - 2 * gguf_conversion.STALE_PARTIAL_S  # a day old: a reused pid does not keep it
    os.utime(live, (old, old))
    assert gguf_conversion.remove_stale_partials(tmp_path) == [live]


# -- issue 23: one share/size reader, one selector list ----------------------------------------------
def test_budget_and_recall_read_shares_alike():
    from h2ochat.budget import parse_budget
    from h2ochat.recall.tiered import recall_slots
    from h2ochat.sizes import parse_share_or_count, parse_size

    for text in ("0.5", "5e-1", "1e-1", "64"):
        value = parse_share_or_count(text, "--x")
        expected = round(value * 128) if isinstance(value, float) else value
        assert parse_budget(text, 128) == expected == recall_slots(text, 128)
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5GB") == 1_500_000_000
    with pytest.raises(ValueError, match="--parked-bytes"):
        parse_size("lots", "--parked-bytes")
    for bad in ("nan", "inf", "1e999"):
        with pytest.raises(ValueError):
            parse_budget(bad, 128)


def test_one_selector_list_for_the_cache_and_the_masked_reference():
    import torch

    from h2ochat.recall.selector_names import selector_names
    from h2ochat.recall.selectors import get_selector
    from h2ochat.recall.tiered import RecallConfig

    keys, valid, queries = torch.randn(2, 3, 4, 16), torch.ones(2, 3, 4, dtype=torch.bool), torch.randn(2, 5, 16)
    for name in selector_names():
        RecallConfig(16, 4, name)  # the two-tier cache takes it ...
        selector = get_selector(name)  # ... and so does the masked reference (rot8 did not)
        assert selector.score(queries, selector.digest(keys, valid)).shape == (2, 3)
    for bad in ("rot9", "int0", "int04", "rot"):
        with pytest.raises(ValueError):
            RecallConfig(16, 4, bad)
