"""The cache statistics people read (/cache, the status line, `generate --json`), against values
worked out by hand on a tiny model whose attention is uniform.

With the query projections zeroed every query gives each visible key the same weight 1/n, so the
H2O rules can be followed on paper: the accumulated score of a key is a sum of 1/n terms, older
keys always hold more than younger ones, the heavy hitters kept are the first tokens, and the token
evicted at each step is the one just leaving the recent window.
"""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from h2ochat.chat.conversation import Conversation
from h2ochat.chat.settings import ChatSettings
from h2ochat.cli import app
from h2ochat.engine.generation import CacheSettings, Sampling, stream
from h2ochat.loading.models import load
from h2ochat.chat.repl import Repl
from h2ochat.chat.cache_view import cache_view
from h2ochat.console import make_console
from h2ochat.chat.status import status_line

from conftest import build_model, random_ids
from seeds import fresh, seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("seed")
SLOTS, HEAVY, RECENT = 12, 6, 6


@pytest.fixture(scope="module")
def uniform_checkpoint(tmp_path_factory):
    from checkpoints import write_checkpoint

    fresh("model")
    folder = write_checkpoint(tmp_path_factory.mktemp("uniform-llama"), max_position_embeddings=256)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data.zero_()  # every key gets the same attention
    model.save_pretrained(folder)
    return folder


def by_hand(prompt: int, fed: int, heavy: int = HEAVY, recent: int = RECENT) -> dict:
    """Follow H2O (HEAVY heavy + RECENT recent slots, scores summed) with uniform attention: the
    prompt read in one chunk, then ``fed`` tokens one at a time. Returns the evicted shares, the
    tokens held at the end and the ages of the heavy hitters."""
    slots = heavy + recent
    assert prompt <= slots
    # prompt: query i sees keys 0..i, each receives 1/(i + 1)
    held = {j: sum(1 / (i + 1) for i in range(j, prompt)) for j in range(prompt)}
    shares = []
    for t in range(prompt, prompt + fed):
        n = len(held) + 1  # the held keys and the new token itself
        for j in held:
            held[j] += 1 / n
        if len(held) == slots:
            mass = sum(held.values())  # the slots' mass at the moment of the drop
            candidates = [j for j in held if j <= t - recent]  # outside the recent window
            dropped = min(candidates, key=lambda j: held[j])
            shares.append(held.pop(dropped) / mass)
        held[t] = 1 / n
    seen = prompt + fed
    ages = sorted(seen - j for j in held if j <= seen - 1 - recent)  # kept on merit
    return {"shares": shares, "held": set(held), "seen": seen, "ages": ages}


def test_generate_json_reports_the_hand_computed_figures(uniform_checkpoint):
    result = CliRunner().invoke(app, ["generate", "the quick brown fox", "--model", str(uniform_checkpoint),
                                      "--dtype", "float32",
                                      "--raw", "--json", "--budget", str(SLOTS), "--policy", "h2o", "--heavy-ratio", "0.5", "-n", "40",
                                      "--ignore-eos"])  # a random model may draw end-of-text early
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert (record["heavy_slots"], record["recent_slots"], record["sink_slots"]) == (HEAVY, RECENT, 0)
    prompt, generated = record["prompt_tokens"], record["generated_tokens"]
    assert HEAVY <= prompt <= SLOTS and generated == 40  # the scenario worked out above
    hand = by_hand(prompt, generated - 1)  # the last generated token is never fed
    stats = record["cache_stats"]
    mean = sum(hand["shares"]) / len(hand["shares"])
    assert stats["evicted_share"] == pytest.approx(mean, rel=1e-4)
    for layer in stats["layers"]:
        assert layer["evicted_share"] == pytest.approx(mean, rel=1e-4)
        assert layer["evicted_per_head"] == len(hand["shares"])
        assert layer["heavy_age_oldest"] == hand["ages"][-1] == hand["seen"]
        assert layer["heavy_age_median"] == hand["ages"][(len(hand["ages"]) - 1) // 2]  # the lower median
    prompt_part, generated_part = stats["parts"]
    assert prompt_part["held_share"] == pytest.approx(len(hand["held"] & set(range(prompt))) / prompt, abs=1e-4)
    assert generated_part["held_share"] == pytest.approx(
        len(hand["held"] - set(range(prompt))) / (hand["seen"] - prompt), abs=1e-4)


def test_cache_view_and_status_line_show_the_hand_computed_figures(uniform_checkpoint):
    loaded = load(str(uniform_checkpoint), device="cpu", dtype="float32")
    conv = Conversation(loaded.model, loaded.tokenizer, ChatSettings(
        sampling=Sampling(temperature=0.0), max_new_tokens=30, cache=CacheSettings(policy="h2o", budget="32", heavy_ratio=0.5)))
    conv.stop_ids = set()
    out = io.StringIO()
    repl = Repl(conv, make_console(file=out), lambda prompt: "", model_name="tiny")
    repl.handle("hi")
    prompt = len(conv.ids) - 29  # the turn's prompt, then 29 of the 30 generated tokens were fed
    assert 0 < prompt <= 32 < prompt + 29  # the turn's prompt fits, the reply evicts
    hand = by_hand(prompt, 29, heavy=16, recent=16)
    mean = sum(hand["shares"]) / len(hand["shares"])
    repl.handle("/cache")
    text = out.getvalue()
    assert f"mean {mean:.1%} · worst layer" in text
    assert f"median {hand['ages'][(len(hand['ages']) - 1) // 2]} · oldest {hand['seen']}" in text
    assert f"held {mean:.1%} attn" in status_line(conv.cache)
    assert "cold tier" not in text and "recall" not in status_line(conv.cache)  # no --recall: no cold tier
    # the parts: the template's header, then the turn (its prompt and reply)
    (header, start, end), (turn, turn_start, turn_end) = conv.parts()
    assert (start, turn_start, turn_end) == (0, end, len(conv.ids) + len(conv.pending)) and turn == "turn 1: hi"
    for name, first, last in conv.parts():
        held = len(hand["held"] & set(range(first, min(last, hand["seen"])))) / (min(last, hand["seen"]) - first)
        assert re.search(rf"{re.escape(name)}\s+{min(last, hand['seen']) - first}\s+\S+\s+{held:.0%}", text), name


@pytest.mark.parametrize("layers, width", [(40, 80), (80, 80), (80, 120)])
def test_a_deep_model_fits_the_terminal(layers, width, seed):
    model = build_model("llama", seed=seed, num_hidden_layers=layers)
    cache = CacheSettings(policy="h2o", budget="8").build(model)
    for _ in stream(model, cache, random_ids(1, 6), max_new_tokens=12, sampling=Sampling(temperature=1.0, seed=seed)):
        pass
    console = Console(file=io.StringIO(), width=width)  # a terminal that wraps at its width
    console.print(cache_view(cache, [("prompt", 0, 6), ("generated", 6, 17)], width=width))
    lines = console.file.getvalue().splitlines()
    assert all(len(line) <= width for line in lines)
    strips = [line for line in lines if line.startswith(f"  L0–L{layers - 1} ")]
    assert len(strips) == 2  # evicted attention and heavy-hitter age, one line each
    cells = len(strips[0].split(" ", 3)[-1].strip())
    assert cells == (layers if layers <= width - 12 else -(-layers // -(-layers // (width - 12))))
    assert len(lines) < 20  # no per-layer table for a deep model (`/cache layers` asks for it)
