"""Fixtures for the plugin's tests, run in vLLM's own environment (``h2ochat_vllm/ci.sh``): a tiny
random Llama saved to a folder, and a helper that runs vLLM on it in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

RUNNER = Path(__file__).with_name("run_vllm.py")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer Llama with grouped KV heads (4 query heads, 2 KV heads, head dim 32), random weights
    from a fixed seed, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048)
    torch.manual_seed(1234)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)
    return folder


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (length,), generator=generator).tolist() for _ in range(count)]


def run_vllm(tmp_path: Path, **spec) -> dict:
    path = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, str(RUNNER), str(path)], capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])
