"""benchmarks/vllm_offline.py's pure parts, with no vLLM installed: ``--plugin KEY=VALUE`` read as JSON when it
parses, the budget from ``--share`` rounded down on the decimal typed (or given once as ``budget``), the
configurations checked, and each configuration's job handed to its own child (here a stand-in for vLLM's Python
that records what it was given): full with vLLM's plugins off, the plugin with the settings as given. The vLLM
scripts' --help runs in h2ochat's venv, which has no vLLM."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def offline():
    """benchmarks/vllm_offline.py as a module (benchmarks/ is no package)."""
    if "vllm_offline" not in sys.modules:
        spec = importlib.util.spec_from_file_location("vllm_offline", ROOT / "benchmarks" / "vllm_offline.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["vllm_offline"] = module
        spec.loader.exec_module(module)
    return sys.modules["vllm_offline"]


@pytest.mark.parametrize("text, expected", [
    ("budget=256", ("budget", 256)), ("recall=0.5", ("recall", 0.5)), ("policy=h2o:sinks=1", ("policy", "h2o:sinks=1")),
    ("selector=exact", ("selector", "exact")), ("recall_memory=2GiB", ("recall_memory", "2GiB")),
    ("flag=true", ("flag", True)), ("name=\"32\"", ("name", "32")), (" key = 3", ("key", 3)), ("empty=", ("empty", "")),
])
def test_a_setting_is_json_when_it_parses_else_the_string_typed(text, expected):
    assert offline().plugin_setting(text) == expected


@pytest.mark.parametrize("text", ["budget", "=3", ""])
def test_a_setting_without_a_key_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        offline().plugin_setting(text)


def test_the_budget_is_the_share_of_the_length_rounded_down_on_the_decimal_typed():
    budget_of = offline().budget_of
    assert budget_of(0.25, 1024) == 256
    assert budget_of(0.29, 100) == 29  # int(0.29 * 100) is 28
    assert budget_of(0.3, 1001) == 300
    assert budget_of(1.0, 4096) == 4096


def test_settings_merge_defaults_then_the_pairs_in_order_and_take_the_budget_once():
    settings = offline().plugin_settings
    assert settings([], None, 1024) == {"budget": 256}
    assert settings([("policy", "h2o:sinks=2")], 0.5, 1000, {"policy": "h2o:sinks=1", "score_queries": 32}) == {
        "policy": "h2o:sinks=2", "score_queries": 32, "budget": 500}
    assert settings([("budget", 128), ("budget", 192)], None, 1024) == {"budget": 192}
    with pytest.raises(ValueError, match="--share or --plugin budget"):
        settings([("budget", 128)], 0.25, 1024)


def test_configs_are_checked():
    parse = offline().parse_configs
    assert parse("full, plugin,full") == ["full", "plugin"]
    for bad in ("", "full,h2o", ","):
        with pytest.raises(ValueError, match="--configs"):
            parse(bad)


def test_the_options_parse_and_the_share_is_recorded_when_it_sets_the_budget(tmp_path):
    module = offline()
    parser = argparse.ArgumentParser()
    module.add_options(parser, length=1024, block_size=32)
    python = tmp_path / "python"
    python.write_text("")
    args = parser.parse_args(["--model-dir", str(tmp_path), "--vllm-python", str(python), "--configs", "plugin",
                              "--plugin", "recall=0.5", "--plugin", "selector=exact"])
    configs, settings = module.check_options(args, {"policy": "h2o:sinks=1"})
    assert configs == ["plugin"] and settings == {"policy": "h2o:sinks=1", "recall": 0.5, "selector": "exact",
                                                  "budget": 256}
    assert module.recorded(args, configs, settings)["share"] == 0.25
    engine = module.engine_options(args, 1536)
    assert (engine["block_size"], engine["max_num_batched_tokens"], engine["enable_prefix_caching"]) == (32, 128, False)
    args = parser.parse_args(["--model-dir", str(tmp_path), "--vllm-python", str(python), "--configs", "full"])
    assert module.recorded(args, *module.check_options(args))["plugin_settings"] is None
    args = parser.parse_args(["--model-dir", str(tmp_path / "nowhere"), "--vllm-python", str(python)])
    with pytest.raises(ValueError, match="--model-dir"):
        module.check_options(args)


# a stand-in for vLLM's Python: it records the job and the environment it was given, and answers each prompt
# with its own last token
STAND_IN = """#!{python}
import json, os, sys
job = json.load(open(sys.argv[2]))
json.dump({{"answers": [ids[-1:] for ids in job["prompts"]], "finish": ["stop"] * len(job["prompts"]),
           "dtype": "float32", "plugin": job["plugin"], "script": sys.argv[1], "job": job,
           "env": {{"VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS"), "PYTHONPATH": os.environ.get("PYTHONPATH")}}}},
          open(sys.argv[3], "w"))
"""


@pytest.mark.slow
def test_each_configuration_runs_in_its_own_child_with_its_job(tmp_path, monkeypatch):
    module = offline()
    python = tmp_path / "vllm-python"
    python.write_text(STAND_IN.format(python=sys.executable))
    python.chmod(0o755)
    parser = argparse.ArgumentParser()
    module.add_options(parser, length=64, block_size=16)
    args = parser.parse_args(["--model-dir", str(tmp_path), "--vllm-python", str(python), "--plugin", "budget=32"])
    configs, settings = module.check_options(args)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    runs = module.run_configs(args, configs, settings, [[1, 2, 3], [4, 5]], [8, 4], max_model_len=576,
                              stop_token_ids=[2])
    assert list(runs) == ["full", "plugin"]
    for config, run in runs.items():
        assert run["answers"] == [[3], [5]]
        assert Path(run["script"]) == ROOT / "benchmarks" / "vllm_offline.py"
        assert run["job"]["max_tokens"] == [8, 4] and run["job"]["stop_token_ids"] == [2]
        assert run["job"]["engine"]["max_model_len"] == 576 and run["env"]["PYTHONPATH"] is None
    assert runs["full"]["plugin"] is None and runs["full"]["env"]["VLLM_PLUGINS"] == "none"
    assert runs["plugin"]["plugin"] == {"budget": 32} and runs["plugin"]["env"]["VLLM_PLUGINS"] is None

    python.write_text("#!/bin/sh\nexit 3\n")
    with pytest.raises(RuntimeError, match="full configuration's vLLM process exited with 3"):
        module.run_configs(args, ["full"], settings, [[1]], [1], max_model_len=576)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vllm_ruler", "vllm_passkey"])
def test_help_runs_without_vllm(name, tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "--plugin KEY=VALUE" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
def test_bad_options_end_in_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_ruler.py"), "--model-dir", str(tmp_path),
                           "--share", "0.25", "--plugin", "budget=128"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("give the budget once: --share or --plugin budget=TOKENS, not both")
