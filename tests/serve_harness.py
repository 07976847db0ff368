"""A tiny checkpoint whose greedy text is clean, for tests that drive a live `h2ochat serve`
(``h2ochat.serve.process.ServerProcess``), and the fixture pattern that starts and stops one."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from h2ochat.serve.process import ServerProcess

from checkpoints import write_checkpoint

STOP_TOKENS = ("</s>", "<|end|>")


def clean_checkpoint(folder: Path, **config) -> Path:
    """A tiny random Llama (``write_checkpoint``) whose output layer gives every token that is not
    plain printable text (bytes of a split character, <pad>, <s>) a logit of exactly 0: greedy decoding
    never picks one (the largest of some 200 random logits is never 0), so a reply's text spells its
    tokens exactly and a client can send it back as the next turn's history. End tokens stay possible."""
    write_checkpoint(folder, **config)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    vocab = tokenizer.get_vocab()
    keep = {vocab[name] for name in STOP_TOKENS}
    for token in range(model.config.vocab_size):
        text = tokenizer.decode([token], skip_special_tokens=True)  # <s>, <pad>: "" (never chosen)
        if token not in keep and not (text and text.isascii() and text.isprintable()):
            with torch.no_grad():
                model.lm_head.weight[token].zero_()
    model.save_pretrained(folder)
    return folder


def fresh_checkpoint(tmp_path_factory, name: str) -> Path:
    """A module's clean checkpoint (``clean_checkpoint``, 1,024 positions), its weights drawn from a
    fresh seed named ``name``."""
    from seeds import fresh

    fresh(name)
    return clean_checkpoint(tmp_path_factory.mktemp(name), max_position_embeddings=1024)


@contextmanager
def running(folder: Path, *args: str, log_dir: Path):
    """A ready server on ``folder`` with ``args``; stopped after, and its output must hold no traceback.
    Eager unless ``args`` ask for ``--compile`` (what these servers test is not the compiled step, whose
    own tests compare it with eager; inductor's C++ would add a minute per server on CI); fp32 unless they name
    a --dtype (auto is bf16 on a CPU with native bf16; the tests compare replies with fp32 references)."""
    if "--compile" not in args:
        args = (*args, "--no-compile")
    if "--dtype" not in args:
        args = (*args, "--dtype", "float32")
    server = ServerProcess(str(folder), *args, log_path=log_dir / "server.log")
    try:
        server.wait_ready(timeout=180)
        yield server
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()
