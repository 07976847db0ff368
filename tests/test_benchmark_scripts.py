"""Every benchmark script that writes JSON writes it through benchmarks/json_report.py (the results
envelope: what, command, commit, machine, date, figures), so that tools/render_results.py can read
every results file the same way. A static check: a script calling json.dump or json.dumps imports
json_report, unless it is a raw log listed below with the reason."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

# scripts that write JSON but no results file: what they write instead
RAW_LOGS = {
    "json_report.py": "the envelope itself",
    "heldout_texts.py": "writes the held-out texts and prints their listing, no figures",
    "recall_rerun_trials.py": "prints one JSON line per trial, a log that passkey_totals.py totals into a report",
    "ruler_kvpress.py": "writes one JSON line per sample, a log that ruler_summary.py summarises into a report",
    "serve_memory_timeline.py": "writes one JSON line per memory sample while a load runs beside it",
    "vllm_offline.py": "writes the job file each vLLM child reads and the answers it writes back, no figures",
}


def writes_json(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr in ("dump", "dumps") and isinstance(node.func.value, ast.Name)
               and node.func.value.id == "json" for node in ast.walk(tree))


def imports_json_report(tree: ast.AST) -> bool:
    return any((isinstance(node, ast.ImportFrom) and node.module == "json_report")
               or (isinstance(node, ast.Import) and any(alias.name == "json_report" for alias in node.names))
               for node in ast.walk(tree))


def test_every_script_parses():
    for script in SCRIPTS:
        ast.parse(script.read_text(encoding="utf-8"), filename=str(script))


def test_a_script_writing_json_writes_it_in_the_envelope():
    unwrapped = [script.name for script in SCRIPTS if script.name not in RAW_LOGS
                 and writes_json(tree := ast.parse(script.read_text(encoding="utf-8"))) and not imports_json_report(tree)]
    assert not unwrapped, (f"{', '.join(unwrapped)} write JSON without benchmarks/json_report.py: build the figures "
                           "dict and write it with json_report.emit or .write (or list a raw log in RAW_LOGS)")


def test_the_raw_logs_listed_are_scripts_that_write_json_their_own_way():
    names = {script.name for script in SCRIPTS}
    for name in RAW_LOGS:
        assert name in names, f"{name} is gone: drop it from RAW_LOGS"
        tree = ast.parse((ROOT / "benchmarks" / name).read_text(encoding="utf-8"))
        assert name == "json_report.py" or not imports_json_report(tree), f"{name} uses json_report: drop it"


def test_the_check_catches_a_script_writing_json_its_own_way():
    own_way = ast.parse("import json\nfrom pathlib import Path\nPath('results_x.json').write_text(json.dumps({}))\n")
    enveloped = ast.parse("import json\nfrom json_report import emit\nprint(json.dumps({}))\nemit({}, None)\n")
    assert writes_json(own_way) and not imports_json_report(own_way)
    assert imports_json_report(enveloped)
    assert not writes_json(ast.parse("import json\nx = json.loads('{}')\n"))


# scripts whose --help costs only their imports (argparse scripts; the rest need a model or a server to do anything)
HELP = ["attention_layout", "bench_kernels", "cold_store_growth", "gpu_check", "mixed_step", "newcomer_trial",
        "passkey_totals", "peers", "quant_roundtrip", "recall_bound_pruning", "recall_compile", "recall_host_memory",
        "recall_prefill_cost", "recall_query_drift", "recall_row_memory", "recall_rows_passkey",
        "recall_rows_perplexity", "recall_selectors", "recall_served_step", "row_move_cost", "ruler_summary",
        "serve_load", "serve_mixed_lengths", "serve_profile", "serve_recall_load", "serve_step_dtype",
        "weight_streaming"]


@pytest.mark.slow
@pytest.mark.parametrize("name", HELP)
def test_help_runs(name, tmp_path):
    # run from elsewhere, as a reader would, with this checkout's package first on the path
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def test_every_json_report_in_benchmarks_is_in_the_envelope():
    """Not only results_*.json: a summary or a trial's report kept beside them carries it too
    (JSON-lines logs are raw data, not reports)."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from json_report import is_envelope

    bare = [path.name for path in sorted((ROOT / "benchmarks").glob("*.json"))
            if not is_envelope(json.loads(path.read_text(encoding="utf-8")))]
    assert not bare, f"JSON reports without the envelope: {bare}"
