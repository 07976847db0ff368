"""benchmarks/peers.py's pure parts, with no peer installed: the load presets give chat_load.py the
issue's arguments, an engine that is not installed is skipped with its reason in the JSON (nothing is
started), the JSON holds the machine and the settings, llama-server's -c holds the KV memory asked for,
and the figures compared are read from chat_load.py's summary."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "peers.py"


def peers():
    """benchmarks/peers.py as a module (benchmarks/ is no package)."""
    if "peers_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("peers_bench", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["peers_bench"] = module  # its dataclasses resolve their annotations through it
        spec.loader.exec_module(module)
    return sys.modules["peers_bench"]


def test_presets_give_the_issues_loads():
    presets = peers().PRESETS
    assert presets["chat-8x4"].load_args() == ["--clients", "8", "--turns", "4", "--reply-tokens", "64"]
    assert presets["outgrow-32x8"].load_args() == ["--clients", "32", "--turns", "8", "--reply-tokens", "64"]
    assert presets["single"].load_args() == ["--clients", "1", "--turns", "4", "--reply-tokens", "64"]
    assert presets["single"].single_stream and not presets["chat-8x4"].single_stream


def test_defaults_one_thread_one_gib_every_engine(tmp_path):
    args = peers().parse_args(["--out", str(tmp_path / "r.json")])
    assert (args.preset, args.threads, args.kv_gib) == (["chat-8x4"], 1, 1.0)
    assert args.engine == ["h2ochat", "vllm", "llama.cpp"]
    h2ochat = peers().h2ochat_engine(args).command
    assert h2ochat[h2ochat.index("--threads") + 1] == "1" and h2ochat[h2ochat.index("--kv-memory") + 1] == "1.0GiB"


def test_cpus_pin_both_engines_to_one_set_with_a_thread_each(tmp_path, monkeypatch):
    module = peers()
    monkeypatch.setattr(module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    args = module.parse_args(["--out", str(tmp_path / "r.json"), "--cpus", "0-1,3"])
    assert args.cpus == {0, 1, 3} and args.threads == 3
    h2ochat = module.h2ochat_engine(args).command
    assert h2ochat[h2ochat.index("--threads") + 1] == "3"
    monkeypatch.setattr(module, "gguf_hf_folder", lambda: tmp_path)
    assert module.vllm_engine(args).env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,3"
    pinned = []
    monkeypatch.setattr(module.os, "sched_setaffinity", lambda pid, cpus: pinned.append((pid, cpus)))
    module.pinned(args.cpus)()
    assert pinned == [(0, {0, 1, 3})] and module.pinned(None) is None
    with pytest.raises(SystemExit):  # a CPU this process may not run on: argparse's one-line error
        module.parse_args(["--out", str(tmp_path / "r.json"), "--cpus", "7"])


def test_missing_peers_are_skipped_with_the_reason_and_nothing_starts(tmp_path, monkeypatch):
    module = peers()
    started = []
    monkeypatch.setattr(module, "run_load", lambda *a: started.append(a))
    out = tmp_path / "r.json"
    args = module.parse_args(["--preset", "chat-8x4", "--preset", "single", "--engine", "vllm", "--engine", "llama.cpp",
                              "--vllm-venv", str(tmp_path / "no-vllm"), "--llama-server", str(tmp_path / "no-llama"),
                              "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    module.run(args)
    report = json.loads(out.read_text())["figures"]  # (in the results envelope)
    assert started == [] and report["runs"] == []  # `single` times `h2ochat generate` only when h2ochat runs
    assert [(s["engine"], s["preset"]) for s in report["skipped"]] == [
        ("vllm", "chat-8x4"), ("llama.cpp", "chat-8x4"), ("vllm", "single"), ("llama.cpp", "single")]
    assert all(s["reason"].startswith("not installed") for s in report["skipped"])
    assert str(tmp_path / "no-vllm") in report["skipped"][0]["reason"]
    for key in ("cpu", "logical_cpus", "physical_cores", "bf16_flags", "torch"):
        assert key in report["machine"]
    assert (report["threads"], report["kv_gib"], report["cpus"]) == (1, 1.0, None) and "finished" in report


def test_llama_context_holds_the_kv_memory_in_whole_slots():
    module = peers()
    context = module.llama_context(1.0, 8)
    assert context % 8 == 0
    assert context * module.KV_BYTES_PER_TOKEN_F16 <= 2**30 < (context + 8) * module.KV_BYTES_PER_TOKEN_F16


def test_figures_come_from_chat_loads_summary():
    summary = {"requests": 32, "wall_s": 100.0, "generated_tokens": 2048, "prompt_tokens": 9, "gen_tok_per_s": 20.48,
               "ttft_p50": 2.5, "ttft_p90": 4.8, "ttft_max": 6.0, "itl_p50": 0.25, "itl_p90": 0.4,
               "latency_p50": 18.0, "label": "ignored"}
    figures = peers().result_figures(summary)
    assert figures["gen_tok_per_s"] == 20.48 and figures["ttft_p90"] == 4.8 and "label" not in figures


def test_shell_command_names_the_environment_first():
    assert peers()._shell(["vllm", "serve", "a b"], {"X": "1"}) == "X=1 vllm serve 'a b'"


def test_profile_samples_are_shared_by_phase_and_innermost_frame(tmp_path):
    raw = tmp_path / "p.txt"
    raw.write_text("engine;_prefill_step (h2ochat/serve/scheduler.py:140);forward (torch/nn/modules/linear.py:125) 6\n"
                   "engine;_decode_step (h2ochat/serve/scheduler.py:170);update (h2ochat/kv/cache.py:9) 3\n"
                   "main;serve (uvicorn/server.py:1) 1\n")
    summary = peers().summarize_profile(raw)
    assert summary["samples"] == 10
    assert summary["by_phase"] == {"prefill": 0.6, "decode": 0.3, "other (server, tokenizer, waiting)": 0.1}
    assert summary["by_phase_and_leaf"]["prefill: linear layers"] == 0.6
    assert summary["by_phase_and_leaf"]["decode: kv cache (H2O)"] == 0.3


@pytest.mark.slow  # (git archive, and a Python started in the tree)
def test_a_baseline_revision_runs_before_h2ochat_from_its_own_tree(tmp_path):
    """--h2ochat-baseline REV: the same serve command, from REV's tree (PYTHONPATH and working folder on
    it, the renamed package folders linked), listed just before h2ochat."""
    import subprocess

    module = peers()
    args = module.parse_args(["--engine", "h2ochat", "--h2ochat-baseline", "HEAD", "--out", str(tmp_path / "r.json")])
    baseline, current = module.engines_for(args, module.PRESETS["chat-8x4"], tmp_path)
    assert (baseline.name, current.name) == ("h2ochat-baseline", "h2ochat") and baseline.skipped is None
    assert baseline.command == current.command and baseline.cwd == baseline.env["PYTHONPATH"]
    tree = Path(baseline.cwd)
    assert (tree / "h2ochat" / "cli.py").is_file() and (tree / "h2ochat_kernels" / "reference.py").is_file()
    where = subprocess.run([sys.executable, "-c", "import h2ochat, h2ochat_kernels; print(h2ochat.__file__, "
                            "h2ochat_kernels.__file__)"], cwd=tree, env={"PYTHONPATH": str(tree)},
                           capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(path).resolve().is_relative_to(tree.resolve()) for path in where)


@pytest.mark.slow  # (git rev-parse)
def test_an_unknown_baseline_revision_is_skipped_with_the_reason(tmp_path):
    module = peers()
    args = module.parse_args(["--engine", "h2ochat", "--h2ochat-baseline", "no-such-rev", "--out", str(tmp_path / "r")])
    baseline, _ = module.engines_for(args, module.PRESETS["chat-8x4"], tmp_path)
    assert baseline.skipped.startswith("no tree for no-such-rev")


def test_skip_leaves_one_engine_out_of_one_preset_and_says_so(tmp_path):
    module = peers()
    args = module.parse_args(["--preset", "chat-8x4", "--preset", "outgrow-32x8", "--engine", "llama.cpp",
                              "--llama-server", "/bin/true", "--skip", "llama.cpp:outgrow-32x8", "--out", str(tmp_path / "r")])
    [short] = module.engines_for(args, module.PRESETS["chat-8x4"], tmp_path)
    [long] = module.engines_for(args, module.PRESETS["outgrow-32x8"], tmp_path)
    assert long.skipped == "left out by --skip llama.cpp:outgrow-32x8"
    assert short.skipped is None or short.skipped.startswith("no GGUF")  # (not the --skip)
    with pytest.raises(SystemExit):
        module.parse_args(["--skip", "llama.cpp", "--out", str(tmp_path / "r")])
