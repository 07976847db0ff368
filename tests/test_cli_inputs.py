"""Issue 31 ("a newcomer's second hour") and issue 33 item 6 ("one config"), at the command line:
--threads above the CPUs, --recall and --budget errors that speak of what was typed, /cache's
plural, every command's cache options declared once from CacheSettings, and help, typos and
`history` answered without importing torch."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from dataclasses import fields
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from conftest import replace_loader

from h2ochat import threads
from h2ochat.chat.settings import check_fits
from h2ochat.cli import app, build_command
from h2ochat.config import CacheSettings
from h2ochat.errors import UserError

runner = CliRunner()


class Loaded(Exception):
    """The loader was reached: every option check before it passed."""


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise Loaded
    replace_loader(monkeypatch, refuse)


def one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, Loaded), result.output
    text = " ".join(result.output.replace("│", " ").split())  # CliRunner shows a usage error in a box
    for needle in needles:
        assert needle in text, text
    return text


# -- C: --threads ---------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "run", "story", "eval", "bench", "serve"])
def test_threads_above_the_cpus_are_refused_while_parsing(no_load, monkeypatch, command):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    result = runner.invoke(app, [command, "--threads", "999"])
    one_line_error(result, "999 is more than the 2 CPUs")
    required = ["--text", "story.txt"] if command == "eval" else []  # its one required option
    result = runner.invoke(app, [command, *required], env={"H2OCHAT_THREADS": "3"})
    one_line_error(result, "3 is more than the 2 CPUs", "H2OCHAT_THREADS")


def test_omp_num_threads_above_the_cpus_is_refused_in_one_line(no_load, monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2001")
    result = runner.invoke(app, ["generate", "hi"])
    one_line_error(result, "OMP_NUM_THREADS 2001 is more than the 2 CPUs")


def test_threads_up_to_the_cpus_are_taken(no_load, monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    assert threads.check_count(2) == 2
    with pytest.raises(ValueError, match="at most 2"):
        threads.check_count(3)
    result = runner.invoke(app, ["generate", "hi", "--threads", "2"])
    assert isinstance(result.exception, Loaded), result.output  # past every check, to the loader


# -- D: --recall ----------------------------------------------------------------------------------
@pytest.mark.parametrize("recall, needles", [
    ("-3", ("--recall -3", "cannot be negative")),
    ("1.0", ("--recall 1.0", "[0, 1)")),
    ("1.5", ("--recall 1.5", "[0, 1)")),
    ("lots", ("a slot count like 64", "auto")),
])
def test_recall_errors_speak_of_what_was_written(no_load, recall, needles):
    text = one_line_error(runner.invoke(app, ["generate", "hi", "--recall", recall]), *needles)
    assert "214748" not in text  # no count made up from a window not known yet


@pytest.mark.parametrize("off", ["0", "0.0", "0e0", "off"])
def test_recall_zero_written_as_a_share_is_off(no_load, off):
    assert CacheSettings(recall=off).recall_config(256) is None
    # recall under a policy that never evicts is refused, no recall is not
    result = runner.invoke(app, ["generate", "hi", "--recall", off, "--policy", "full"])
    assert isinstance(result.exception, Loaded), result.output


def test_a_recall_count_is_checked_against_the_real_budget(no_load):
    one_line_error(runner.invoke(app, ["generate", "hi", "--budget", "64", "--recall", "64"]),
                   "--recall 64 takes all 64 slots")
    # a share of the window: the count waits for the model's window (256 positions: 26 slots)
    settings = CacheSettings(budget="0.1", recall="32", page=4)
    settings.validate()
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=256, num_hidden_layers=2))
    with pytest.raises(UserError, match="--recall 32 takes all 26 slots"):
        check_fits(settings, model)
    with pytest.raises(UserError, match="less than one slot"):
        check_fits(CacheSettings(budget="0.1", recall="0.01", page=4), model)


# -- E: --budget sizes, /cache's plural -----------------------------------------------------------
@pytest.mark.parametrize("budget, needles", [
    ("16XB", ("--budget 16XB", "unknown unit 'XB'", "a size like 16MiB")),
    ("-1MiB", ("--budget -1MiB", "negative", "a size like 16MiB")),
    ("1e99GiB", ("--budget 1e99GiB", "too large", "a size like 16MiB")),
    ("lots", ("a share like 0.2, a count like 512 or a size like 16MiB",)),
])
def test_budget_size_errors_name_the_size_form_and_the_fault(no_load, budget, needles):
    one_line_error(runner.invoke(app, ["generate", "hi", "--budget", budget]), *needles)


@pytest.mark.parametrize("per_summary, words", [(1, "1 page each"), (2, "2 pages each")])
def test_cache_view_agrees_page_with_its_count(per_summary, words):
    from h2ochat.recall.report import TierSummary
    from h2ochat.chat.split import Parts, Split
    from h2ochat.chat.cache_view import cold_tier_lines

    tier = TierSummary(recall_slots=8, page=4, selector="exact", cold_limit=None, rows=2, cold_pages=1.0,
                       cold_tokens=4.0, dropped_tokens=0.0, host_bytes=64, digest_bytes=32, staged_tokens=0.0,
                       device_bytes=48, pages_per_summary=per_summary, summary_cap=64, pages_copied=0.0,
                       pages_copied_turn=0.0, recalled_share=None, recalled_share_turn=None, this_turn=False)
    parts = Parts(sinks=0, heavy=8, recent=8, recall=8)
    text = " ".join(line.plain for line in cold_tier_lines(tier, Split(slots=parts, held=parts)))
    assert f"64 summaries cap, {words}" in text


# -- A: one config --------------------------------------------------------------------------------
COMMAND_DEFAULTS = {"generate": {"recall": "auto"}, "run": {"recall": "auto"},
                    "story": {"recall": "auto", "budget": "0.05"}, "serve": {"recall": "auto"}}


@pytest.mark.parametrize("command", COMMAND_DEFAULTS)
def test_every_cache_field_is_an_option_with_the_dataclass_default(command):
    params = {param.name: param for param in build_command(command).params}
    for field in fields(CacheSettings):
        if field.name == "seed":  # the sampling's --seed (serve has none)
            continue
        expected = COMMAND_DEFAULTS[command].get(field.name, field.default)
        assert field.name in params, f"{command} lacks --{field.name.replace('_', '-')}"
        assert params[field.name].default == expected, (command, field.name)
    assert params["prefill_chunk"].default == 512


def test_a_command_receives_its_cache_settings_checked(monkeypatch):
    from h2ochat import options as o

    seen = {}

    @o.takes_cache_options(budget="0.05")
    def command(seed: int = 3, settings: CacheSettings = None, prefill_chunk: int = 0):
        seen.update(settings=settings, prefill_chunk=prefill_chunk)

    single = typer.Typer()
    single.command()(command)
    result = CliRunner().invoke(single, ["--policy", "mean", "--prefill-chunk", "64"])
    assert result.exit_code == 0, result.output
    assert seen["settings"] == CacheSettings(policy="mean", budget="0.05", seed=3, recall="auto")
    assert seen["prefill_chunk"] == 64
    result = CliRunner().invoke(single, ["--positions", "sideways"])
    assert isinstance(result.exception, UserError) and "--positions" in str(result.exception)


@pytest.mark.slow
def test_the_config_module_imports_no_torch():
    code = ("import sys, h2ochat.config, h2ochat.options, h2ochat.chat.settings; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


# -- B: help, typos and history without torch -----------------------------------------------------
def cpu_seconds(args: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    """The CPU time (user + system) a child took: unlike the wall clock, other jobs on the machine
    do not stretch it. Importing torch takes over 2 s of it on this machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, done


@pytest.mark.slow
@pytest.mark.parametrize("args, code", [(["generate", "--help"], 0), (["serve", "--help"], 0), (["run", "--help"], 0),
                                        (["history"], 0), (["generate", "--bogus"], 2), (["generate", "--threads", "x"], 2)])
def test_help_typos_and_history_answer_within_a_second_of_cpu(tmp_path, args, code):
    env = {**os.environ, "H2OCHAT_HOME": str(tmp_path), "COLUMNS": "120"}
    baseline, _ = cpu_seconds([sys.executable, "-c", "pass"], env)
    spent, done = cpu_seconds([sys.executable, "-m", "h2ochat.cli", *args], env)
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert spent <= 1.0 + baseline, f"h2ochat {' '.join(args)} took {spent:.2f} s of CPU (python alone {baseline:.2f} s)"


@pytest.mark.parametrize("flags, compile", [([], None), (["--compile"], True), (["--no-compile"], False)])
def test_serve_compiles_unless_told_not_to(monkeypatch, flags, compile):
    """`serve` hands the server compile=None when not told (compiled where the step covers its rows:
    ``serve.backend.compiles_by_default``); --compile and --no-compile decide it."""
    from h2ochat.serve import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda config: seen.setdefault("config", config) and 0)
    result = CliRunner().invoke(app, ["serve", "--random-weights", "--model", "smollm2-135m", *flags])
    assert result.exit_code == 0, result.output
    assert seen["config"].compile is compile
