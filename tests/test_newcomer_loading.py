"""Loading as a newcomer meets it: a model path that is not a model says what is missing, the GGUF
copy is found again by the file's content (not its modification time) and a cache that cannot be
written is said, transformers' dtype advice is not shown, and --compile says why the text pauses."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from h2ochat.loading import gguf_conversion
from h2ochat.loading.sources import ModelError, missing_parts, resolve


# -- item 15: what a path lacks ------------------------------------------------------------------
def test_a_folder_with_only_a_config_says_what_is_missing(h2ochat_main, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    result = h2ochat_main("generate", "hi", "-n", "1", "--model", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line = result.stderr.strip()
    assert "no weights" in line and "no tokenizer" in line and not line.endswith(":"), line


def test_missing_parts_names_each_part(tmp_path):
    assert missing_parts(tmp_path) == ["weights (*.safetensors or *.bin)",
                                       "tokenizer (tokenizer.json or tokenizer.model or a vocabulary file)"]
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert missing_parts(tmp_path) == []


def test_a_missing_path_and_a_text_file_are_named_as_such(tmp_path):
    with pytest.raises(ModelError, match="no such file or folder: /nonexistent/model"):
        resolve("/nonexistent/model")
    with pytest.raises(ModelError, match="no such file or folder: ./nope"):
        resolve("./nope")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelError, match="is a file, not a model"):
        resolve(str(text))
    assert resolve("org/name").kind == "hub"  # a hub id stays one


def test_a_library_message_is_kept_whole_on_one_line():
    from h2ochat.loading.models import one_paragraph

    assert one_paragraph("Couldn't instantiate the backend tokenizer from one of:\n(1) a `tokenizers` file\n") == \
        "Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` file"


# -- item 16: the GGUF copy's key -------------------------------------------------------------------
def test_the_converted_copy_is_keyed_by_content_not_time(tmp_path, monkeypatch):
    monkeypatch.setenv("H2OCHAT_CACHE_DIR", str(tmp_path / "cache"))
    first = tmp_path / "a" / "model.gguf"
    first.parent.mkdir()
    noise = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(16))
    first.write_bytes(noise.numpy().tobytes())
    second = tmp_path / "b" / "model.gguf"  # a fresh install: the same bytes, another time
    second.parent.mkdir()
    second.write_bytes(first.read_bytes())
    os.utime(second, (1_000_000, 1_000_000))
    assert gguf_conversion.converted_gguf_dir(first, "float32") == gguf_conversion.converted_gguf_dir(second, "float32")
    changed = bytearray(first.read_bytes())
    changed[-1] ^= 1  # the last tensor's last byte
    second.write_bytes(bytes(changed))
    assert gguf_conversion.converted_gguf_dir(first, "float32") != gguf_conversion.converted_gguf_dir(second, "float32")
    assert gguf_conversion.converted_gguf_dir(first, "float32").parent == tmp_path / "cache" / "gguf"


def test_a_cache_that_cannot_be_written_is_said(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    model = SimpleNamespace(config=SimpleNamespace())
    said = gguf_conversion.keep_converted(model, None, blocker / "gguf" / "model-1-x-float32")
    assert said is not None and "every run converts the GGUF file again" in said and "H2OCHAT_CACHE_DIR" in said


def test_the_load_says_a_failed_keep_once(monkeypatch, capsys):
    """The loader prints keep_converted's words as one warning line (the rest of the load faked)."""
    from h2ochat.loading import models

    source = SimpleNamespace(kind="gguf", family="llama", name="x.gguf", location="/x/x.gguf")
    fake_model = SimpleNamespace(to=lambda device: None, eval=lambda: None)
    fake_tokenizer = SimpleNamespace(pad_token_id=0)
    monkeypatch.setattr(models, "resolve", lambda name: source)
    monkeypatch.setattr(models, "parameter_count", lambda source, folder: 1)
    monkeypatch.setattr(models, "check_memory", lambda *a, **k: None)
    monkeypatch.setattr(models, "converted_gguf_dir", lambda folder, dtype: Path("/nonexistent/copy"))
    monkeypatch.setattr(models, "remove_stale_partials", lambda folder: [])
    monkeypatch.setattr(models, "keep_converted", lambda model, tokenizer, target: "could not keep it (reason)")
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: fake_tokenizer)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: fake_model)
    monkeypatch.setattr("h2ochat.engine.packed_linears.pack_linears", lambda model, rows: None)
    models.load("x.gguf", device="cpu", dtype="float32")
    err = capsys.readouterr().err
    assert err.count("h2ochat: warning: could not keep it (reason)") == 1


def test_a_gguf_file_converted_before_is_not_parsed_again(monkeypatch, tmp_path):
    """With the file's converted copy at hand, its parameter count, its configuration and the weights come from the
    copy (headers and config.json: a second), never from parsing the GGUF file (seconds on every start)."""
    from h2ochat.loading import memory, models

    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text("{}")
    source = SimpleNamespace(kind="gguf", family="llama", name="x.gguf", location="/x/x.gguf")
    seen = {}

    def parsed(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed")

    def from_copy(what):
        return lambda folder, *a, **k: seen.setdefault(what, str(folder)) and SimpleNamespace(
            pad_token_id=0, to=lambda device: None, eval=lambda: None)

    monkeypatch.setattr(models, "resolve", lambda name: source)
    monkeypatch.setattr(memory, "_gguf_parameters", parsed)
    monkeypatch.setattr(models, "check_memory", lambda *a, **k: None)
    monkeypatch.setattr(models, "converted_gguf_dir", lambda folder, dtype: copy)
    monkeypatch.setattr(models, "remove_stale_partials", lambda folder: [])
    monkeypatch.setattr(models, "_local_config", lambda source, folder: seen.setdefault("config", (source.kind, folder)))
    monkeypatch.setattr(memory, "_safetensors_parameters", lambda path: 7)
    (copy / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", from_copy("tokenizer"))
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", from_copy("model"))
    monkeypatch.setattr("h2ochat.engine.packed_linears.pack_linears", lambda model, rows: None)
    loaded = models.load("x.gguf", device="cpu", dtype="float32", kv_slots=8)
    assert loaded.params == 7 and seen["config"] == ("dir", copy)
    assert seen["tokenizer"] == seen["model"] == str(copy)


# -- item 14: transformers' dtype advice --------------------------------------------------------------
def test_transformers_dtype_advice_is_not_shown_during_the_load():
    quantizer_log = logging.getLogger("transformers.quantizers.quantizer_gguf")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    quantizer_log.addHandler(handler)
    try:
        with gguf_conversion.quiet_gguf_advice():
            quantizer_log.warning("Pass `dtype=torch.float32` to avoid it")
        quantizer_log.warning("after")
    finally:
        quantizer_log.removeHandler(handler)
    assert seen == ["after"]


# -- item 12: --compile says why the text pauses -------------------------------------------------------
def test_generate_compile_says_it_compiles(h2ochat_main, tiny_checkpoint, monkeypatch, tmp_path):
    import h2ochat.engine.generation as generation

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # (restored after the test)

    eager = generation.decoder
    monkeypatch.setattr(generation, "decoder", lambda model, compile=False: eager(model, False))  # no compiler here
    result = h2ochat_main("generate", "hello", "--model", str(tiny_checkpoint), "-n", "2", "--compile",
                          "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert "compiling the decode step" in result.stderr and "pauses after its first token" in result.stderr
    assert str(tmp_path / "inductor") in result.stderr


# -- item 9: the compiled graphs last ---------------------------------------------------------------------
def test_the_compile_cache_moves_under_h2ochats_cache_unless_chosen(monkeypatch, tmp_path):
    from h2ochat.loading.cache_dirs import persistent_compile_cache

    monkeypatch.setenv("H2OCHAT_CACHE_DIR", str(tmp_path / "h2ochat"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "placeholder")  # (so the test's change is undone)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert persistent_compile_cache() == tmp_path / "h2ochat" / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "h2ochat" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert persistent_compile_cache() == tmp_path / "mine"


SECOND_START = """
from h2ochat.loading.cache_dirs import persistent_compile_cache
persistent_compile_cache()  # (as the command line does, before torch._dynamo is imported)
import torch
from torch._dynamo.utils import counters
step = torch.compile(lambda x: torch.nn.functional.gelu(x) * 3 + 1, fullgraph=True)
step(torch.ones(8))
print("HITS", counters["inductor"]["fxgraph_cache_hit"], "MISSES", counters["inductor"]["fxgraph_cache_miss"])
"""


@pytest.mark.slow
@pytest.mark.skipif(not any(os.access(os.path.join(p, "c++"), os.X_OK) or os.access(os.path.join(p, "g++"), os.X_OK)
                            for p in os.environ.get("PATH", "").split(os.pathsep)), reason="inductor needs a C++ compiler")
def test_a_second_process_reuses_the_first_ones_compiled_graph(tmp_path):
    env = {**os.environ, "H2OCHAT_CACHE_DIR": str(tmp_path / "h2ochat")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    runs = [subprocess.run([sys.executable, "-c", SECOND_START], env=env, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    first, second = (run.stdout.split() for run in runs)
    assert first[1:4:2] == ["0", "1"] and second[1:4:2] == ["1", "0"], (first, second)
    assert (tmp_path / "h2ochat" / "inductor").is_dir()
