"""`--recall` on `generate` and `story`: the flags reach the two-tier cache, the device slots stay the
budget, and the JSON says what the cold tier holds. (The two-tier cache itself is checked against
the masked reference in test_recall_cache.py.)"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from h2ochat.cli import app
from h2ochat.engine.generation import CacheSettings, Sampling, stream
from h2ochat.loading.models import load
from h2ochat.chat.prompting import encode

from seeds import fresh, seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("seed")
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # tests/conftest.py's llama
PROMPT = "once upon a time there was a dragon who lived by the sea"
runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from checkpoints import write_checkpoint

    fresh("model")
    return write_checkpoint(tmp_path_factory.mktemp("recall-llama"))


def kv_bytes(slots: int) -> int:
    return LAYERS * KV_HEADS * slots * HEAD_DIM * 2 * 4  # keys + values, fp32


def test_generate_with_recall_keeps_the_budget_and_reports_the_cold_tier(checkpoint):
    args = ["generate", PROMPT, "--model", str(checkpoint), "--raw", "--json", "--budget", "16", "-n", "30",
            "--ignore-eos", "--policy", "h2o"]
    result = runner.invoke(app, [*args, "--recall", "8", "--page", "4", "--selector", "exact"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["kv_slots"] == 16 and record["kv_bytes"] == kv_bytes(16)  # recall slots are budget slots
    tier = record["recall"]
    assert (tier["recall_slots"], tier["page"], tier["selector"]) == (8, 4, "exact")
    # every token evicted from the 8 hot slots sits in the cold store (an fp32 model's keys in bf16 and values as
    # int8 codes, the default cold format, with their token index and positions beside them): at least those bytes
    assert tier["cold_dtype"] == "bf16-keys"
    assert record["evicted_tokens"] > 0 and tier["cold_host_bytes"] >= record["evicted_tokens"] * HEAD_DIM * (2 + 1)
    assert tier["pages_copied"] > 0

    # the same settings driven in-process give the same text
    loaded = load(str(checkpoint), device="cpu", dtype="float32")
    cache = CacheSettings(policy="h2o", budget="16", recall="8", page=4, selector="exact").build(loaded.model)
    ids = encode(loaded.tokenizer, PROMPT, chat=False)
    tokens = [int(step.tokens[0]) for step in stream(loaded.model, cache, ids, max_new_tokens=30, sampling=Sampling())]
    assert record["text"] == loaded.tokenizer.decode(tokens, skip_special_tokens=True)

    plain = json.loads(runner.invoke(app, args).stdout)
    assert plain["recall"] is None and plain["kv_bytes"] == record["kv_bytes"]


def test_story_with_recall(checkpoint):
    result = runner.invoke(app, ["story", "--model", str(checkpoint), "--prompt", PROMPT, "--budget", "16",
                                 "--tokens", "24", "--recall", "0.5", "--page", "4", "--json", "--seed", "3"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["kv_slots"] == 16 and record["recall"]["recall_slots"] == 8 and record["generated_tokens"] == 24


@pytest.mark.parametrize("extra, message", [
    (["--recall", "30"], "--recall 30 takes all 16 slots of the budget"),
    (["--recall", "8"], "whole number"),  # 8 slots are not a whole number of 16-token pages
    # refused before the model runs, not when the first layer allocates its cold store
    (["--recall", "8", "--page", "4", "--cold-dtype", "int3"], "--cold-dtype must be one of auto, model, int8-values, bf16-keys, int8"),
])
def test_bad_recall_settings_are_one_line(checkpoint, extra, message):
    result = runner.invoke(app, ["generate", "hi", "--model", str(checkpoint), "--budget", "16", "-n", "2", *extra])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
