"""Live `h2ochat serve` processes for tests: a tiny checkpoint whose greedy text is clean, a server
subprocess on a free loopback port, and small helpers to read its metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from h2ochat.serve.metrics import parse

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
        text = tokenizer.decode([token])
        if token not in keep and not (text and text.isascii() and text.isprintable()):
            with torch.no_grad():
                model.lm_head.weight[token].zero_()
    model.save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`h2ochat serve --model FOLDER ARGS` on 127.0.0.1; ``url`` is its base URL, ``log`` its stderr."""

    def __init__(self, folder: Path, *args: str, log: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(folder)
        self.log_path = log
        self._log = open(log, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "h2ochat.cli", "serve", "--model", str(folder), "--host", "127.0.0.1",
             "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not become ready:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        return parse(httpx.get(self.url + "/metrics", timeout=10).text)

    def wait_metrics(self, condition, timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until ``condition(values)`` holds (bounded: a step takes milliseconds here)."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            if condition(values) or time.monotonic() > deadline:
                return values
            time.sleep(0.05)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
