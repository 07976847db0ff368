"""Long-form generation: past the budget and the position limit, in flat cache memory."""

from __future__ import annotations

import re

import torch
from typer.testing import CliRunner

import h2ochat_prompts
from h2ochat.cli import app
from h2ochat.commands.story import tell
from h2ochat.generation import CacheSettings, Sampling
from h2ochat.models import load


def test_story_goes_past_the_position_limit_in_flat_memory(tiny_checkpoint):
    loaded = load(str(tiny_checkpoint), device="cpu")
    limit = loaded.model.config.max_position_embeddings
    cache = CacheSettings(budget="16").build(loaded.model)
    opening = loaded.tokenizer(h2ochat_prompts.read("fox", "story"), return_tensors="pt").input_ids[:, :20]
    memory, pieces = [], []
    tokens = 3 * limit
    for piece in tell(loaded.model, loaded.tokenizer, cache, opening, tokens=tokens,
                      sampling=Sampling(temperature=1.0, seed=int(torch.randint(0, 1000, ())))):
        pieces.append(piece)
        memory.append(cache.kv_bytes())
    assert len(pieces) == tokens  # no stop ids: it keeps going
    assert cache.tokens_seen() == 20 + tokens - 1 > 2 * limit
    assert cache.compactions >= 2
    assert len(set(memory)) == 1  # allocated once, never grown
    assert cache.full_kv_bytes() > 5 * cache.kv_bytes()
    assert all(layer.stats().held == 16 for layer in cache.layers)


def test_story_command_writes_out_file_and_plain_text(tiny_checkpoint, tmp_path):
    out = tmp_path / "story.txt"
    result = CliRunner().invoke(app, ["story", "--model", str(tiny_checkpoint), "--budget", "16", "--tokens", "90",
                                      "--prompt-file", "lighthouse", "--out", str(out), "--seed", "1"],
                                env={"NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    opening = h2ochat_prompts.read("lighthouse")
    text = out.read_text()
    assert text.startswith(opening) and len(text) > len(opening)
    assert opening in result.stdout
    assert "positions re-numbered" in result.output
    assert not re.search(r"\x1b\[", result.output)


def test_prompt_files_resolve_by_name_and_path(tmp_path):
    assert set(h2ochat_prompts.names("story")) >= {"lighthouse", "fox"}
    assert len(h2ochat_prompts.names("system")) >= 2
    own = tmp_path / "mine.txt"
    own.write_text("It was a dark night.\n")
    assert h2ochat_prompts.read(str(own)) == "It was a dark night."
    assert h2ochat_prompts.read("story-fox.txt") == h2ochat_prompts.read("fox")
    assert h2ochat_prompts.system_prompt("concise").startswith("You are")
    assert h2ochat_prompts.system_prompt("Speak French.") == "Speak French."
