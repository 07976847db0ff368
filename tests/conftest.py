"""Tiny random OPT, Llama (GQA) and GPT-NeoX models built from configs: no downloads."""

from __future__ import annotations

import copy
import os

# Triton's library functions are built for whichever mode is active when triton is first imported
# (transformers imports it): switch the interpreter on first, so kernel tests run in this process.
os.environ.setdefault("TRITON_INTERPRET", "1")
# --dtype auto is bf16 on a CPU with native bf16 (h2ochat.loading.native_bf16). A test that compares numbers
# names its dtype (float32 unless it is about another); this keeps auto at fp32 on every machine as well, for any
# test that leaves it out, whatever the caller's environment says (subprocesses inherit it)
os.environ["H2OCHAT_NATIVE_BF16"] = "0"

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

import h2ochat.engine.attention  # noqa: F401  registers the "h2o" attention

VOCAB = 96

CONFIGS = {
    "opt": (OPTForCausalLM, OPTConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
        max_position_embeddings=64, word_embed_proj_dim=64, pad_token_id=1, bos_token_id=2, eos_token_id=2,
        enable_bias=True, do_layer_norm_before=True,
    )),
    "llama": (LlamaForCausalLM, LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )),
    "neox": (GPTNeoXForCausalLM, GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, rotary_pct=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )),
}
FAMILIES = list(CONFIGS)


def build_model(family: str, attn: str = "h2o", seed: int | None = None, **overrides):
    cls, config = CONFIGS[family]
    config = copy.deepcopy(config)  # from_config writes attn_implementation onto the config
    for key, value in overrides.items():
        setattr(config, key, value)
    if seed is not None:
        torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models: one thread is faster than two, and far faster on a machine other jobs load
    (a second OpenMP thread that is not scheduled stalls every matmul)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Modules whose tests start a subprocess or a server, compile, run the Triton interpreter or load the
# real model (each over a few seconds on a 2-core machine): `pytest -m "not slow"` is the fast subset,
# CI runs everything. A test elsewhere marks itself with @pytest.mark.slow.
SLOW_MODULES = {
    "test_kernels_compile", "test_gpu_check", "test_generate_cli", "test_compile", "test_kernel_ops",
    "test_lockstep_before_composition", "test_recall_kernels", "test_kernels_e2e", "test_inactive_rows",
    "test_serve_lifecycle", "test_serve", "test_cli_ux", "test_model_paths", "test_kernels", "test_kernels_quant",
    "test_recall_zero_copy", "test_serve_recall", "test_bench", "test_recall_quant", "test_first_hour",
}


def pytest_collection_modifyitems(items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in SLOW_MODULES or "triton" in item.name:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def fixed_global_seeds(request):
    """torch's and random's global generators start every test from a state fixed by its id, so a
    test that draws without the ``seed`` fixture draws the same whatever ran before it."""
    from seeds import fresh

    fresh("global", request.node.nodeid)


@pytest.fixture
def seed(request) -> int:
    """A seed for torch and random, fixed per test (seeds.fresh: H2OCHAT_TEST_SEED=random draws fresh
    ones, a number replays one), named in the report of a failing test. Modules that import seeds' own
    ``seed`` fixture get the same seeds."""
    from seeds import fresh

    value = fresh("test", request.node.nodeid)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seeds = [value for name, value in item.user_properties if name == "seed"]
    if report.failed and seeds:
        report.sections.append(("random seed", f"seed {seeds[-1]}: replay with H2OCHAT_TEST_SEED={seeds[-1]}"))
    return report


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def model(family):
    return build_model(family)


def triton_interpreter_ready() -> bool:
    """Whether Triton kernels can run on the CPU in this process: triton is installed and its
    library was built for the interpreter (TRITON_INTERPRET=1 before triton's first import)."""
    try:
        import triton.language as tl
    except Exception:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" and type(tl.zeros).__name__ == "InterpretedFunction"


def random_ids(batch: int, length: int, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A directory holding a tiny random Llama with a tokenizer and chat template: `--model DIR`."""
    from checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


# the cold store at the model's dtype: recalled tokens come back as stored, so a recall cache equals its
# masked reference exactly (the default, int8 values, is held to its bound in test_recall_store.py)
EXACT = "model"


def recall_cache(num_layers: int, policy, hot_slots: int, *, recall, **kwargs):
    """An H2OCache of ``hot_slots`` policy slots per layer with a recall tier of ``recall.slots`` more
    (``kv.make_cache`` takes the device total instead)."""
    from h2ochat.kv import H2OCache
    from h2ochat.recall.spec import RecallSpec

    return H2OCache(num_layers, policy, hot_slots, tier=RecallSpec(recall), **kwargs)


def replace_loader(monkeypatch, replacement) -> None:
    """The model loader replaced for one test, wherever a command reaches it: ``loading.models.load`` and
    the ``load`` each command module bound when it was imported. The modules are imported first, with
    the real loader: a command imported for the first time under the replacement would keep it after
    the test (the story test then failed whenever no test module had imported ``commands.story`` before)."""
    import importlib

    from h2ochat.cli import COMMANDS
    from h2ochat.loading import models

    modules = [importlib.import_module(f"h2ochat.commands.{name}") for name in COMMANDS.values()]
    monkeypatch.setattr(models, "load", replacement)
    for module in modules:
        if getattr(module, "load", None) is not None:
            monkeypatch.setattr(module, "load", replacement)


def pytest_terminal_summary(terminalreporter):
    """Which compiled CPU kernel routes this run could take (each route's tests run, or skip for this reason),
    so a run on a CPU without some instruction set says what it did not test."""
    from cpu_routes import routes_report

    terminalreporter.write_line("CPU kernel routes: " + "; ".join(routes_report()))


@pytest.fixture
def h2ochat_main(monkeypatch, capsys):
    """The command line in this process: ``h2ochat_main("generate", ...)`` returns its exit code, stdout, stderr."""
    import subprocess
    import sys

    from h2ochat.cli import main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["h2ochat", *args])
        with pytest.raises(SystemExit) as exited:
            main()
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, exited.value.code, captured.out, captured.err)

    return run
