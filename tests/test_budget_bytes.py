"""--budget as a size (16MiB): the device KV bytes per sequence, over layers and KV heads, codes and
scales counted, turned into the slots that fit at each --kv-dtype (and recall share); the bytes the
cache then reports are within the budget. Bad values are one-line errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch

from conftest import FAMILIES, build_model
from h2ochat.budget import budget_bytes, parse_budget, slots_in_bytes
from h2ochat.cli import main
from h2ochat.engine.generation import CacheSettings, attention_shape, forward
from h2ochat.kv.slot_format import KV_DTYPES
from h2ochat.sizes import is_size
from test_generate_cli import assert_one_line_error

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


def slot_bytes_by_hand(kv_dtype: str, heads: int, head_dim: int, model_bytes: int = 4) -> int:
    """One slot of one layer over its KV heads, written out: a float slot is its key and value
    elements; a quantized one its codes (a byte each for int8, two a byte for int4) plus a float32
    scale and offset for the key and for the value."""
    if kv_dtype in ("int8", "int4"):
        codes = head_dim if kv_dtype == "int8" else -(-head_dim // 2)
        return heads * 2 * (codes + 4 + 4)
    return heads * 2 * head_dim * ELEMENT_BYTES.get(kv_dtype, model_bytes)


@pytest.mark.parametrize("text,expect", [("16MiB", 16 * 2**20), ("512KiB", 512 * 1024), ("1.5GiB", int(1.5 * 2**30)),
                                         ("4096B", 4096), ("2kB", 2000)])
def test_sizes_read_as_bytes(text, expect):
    assert is_size(text)
    assert budget_bytes(text) == expect


@pytest.mark.parametrize("text", ["0.2", "512", "1e-1", "1.0"])
def test_shares_and_counts_are_not_sizes(text):
    assert not is_size(text) and budget_bytes(text) is None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("recall", [None, "0.5"])
def test_budget_in_bytes_fits_and_is_the_most_that_does(family, kv_dtype, recall):
    """The slots of a size are the most whose device KV bytes (as the cache reports them once
    allocated) fit; one slot more would not. Recall slots are device slots of the budget."""
    model = build_model(family, seed=0)
    heads, head_dim = attention_shape(model.config)
    layers = model.config.num_hidden_layers
    per_slot = slot_bytes_by_hand(kv_dtype, heads, head_dim)
    size = 37 * per_slot * layers + per_slot // 2  # 37 slots a layer and a half
    settings = CacheSettings(budget=f"{size}B", kv_dtype=kv_dtype, recall=recall, page=2)
    slots = settings.slots(model.config, model)
    assert slots == 37
    cache = settings.build(model)
    forward(model, cache, torch.randint(3, 90, (1, 5)))
    assert cache.device_slots() == 37
    assert cache.kv_bytes() == 37 * per_slot * layers <= size
    assert cache.kv_bytes_per_slot() == per_slot * layers
    assert (cache.tier.columns > 0) == (recall is not None)


def test_a_shaped_policy_fits_its_layers_in_the_bytes():
    """A policy that shapes the slots by depth (rounding per layer) still fits the size."""
    model = build_model("llama", seed=0)
    settings = CacheSettings(policy="h2o:layer_shape=0.6", budget="20KiB", kv_dtype="int8")
    cache = settings.build(model)
    forward(model, cache, torch.randint(3, 90, (1, 5)))
    assert cache.kv_bytes() <= 20 * 1024
    per_slot = settings.slot_bytes(model)
    assert sum(settings.resolved_policy().layer_slots(settings.slots(model.config, model) + 1, 2)) * per_slot > 20 * 1024


def test_slots_in_bytes_arithmetic():
    flat = lambda slots, layers: [slots] * layers  # noqa: E731
    assert slots_in_bytes(1000, 10, flat, 4) == 25
    assert slots_in_bytes(999, 10, flat, 4) == 24
    with pytest.raises(ValueError, match="holds no slot"):
        slots_in_bytes(39, 10, flat, 4, typed="39B")


def test_a_size_is_not_a_share_or_a_count():
    with pytest.raises(ValueError, match="is a size"):
        parse_budget("16MiB", 2048)


# -- the command line --------------------------------------------------------------------------------

@pytest.fixture
def h2ochat_main(monkeypatch, capsys):
    def run(*args):
        monkeypatch.setattr(sys, "argv", ["h2ochat", *args])
        monkeypatch.setattr(sys, "stdin", io.StringIO(""))
        with pytest.raises(SystemExit) as exited:
            main()
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, exited.value.code, captured.out, captured.err)

    return run


@pytest.mark.parametrize("args,fragments", [
    (("--kv-dtype", "int3"), ("--kv-dtype", "int3")),
    (("--budget", "0MiB"), ("--budget", "0MiB")),
    (("--budget", "100B"), ("--budget 100B holds no slot",)),
    (("--budget", "100B", "--kv-dtype", "int4"), ("holds no slot", "int4")),
])
def test_bad_values_are_one_line_errors(h2ochat_main, tiny_checkpoint, args, fragments):
    assert_one_line_error(h2ochat_main("generate", "hi", "--model", str(tiny_checkpoint), "-n", "2", *args), *fragments)


def test_eval_kv_dtype_int3_is_a_one_line_error(h2ochat_main, tiny_checkpoint, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("once upon a time " * 50)
    assert_one_line_error(h2ochat_main("eval", "--text", str(text), "--model", str(tiny_checkpoint),
                                       "--kv-dtype", "auto,int3"), "--kv-dtype", "int3")


def test_generate_reports_the_bytes_of_a_size_budget(h2ochat_main, tiny_checkpoint):
    result = h2ochat_main("generate", "hello there", "--model", str(tiny_checkpoint), "-n", "3", "--raw",
                          "--budget", "4KiB", "--kv-dtype", "int8", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["kv_dtype"] == "int8"
    assert record["kv_bytes"] <= 4 * 1024
    assert record["kv_bytes"] == record["kv_slots"] * record["kv_bytes_per_slot"]


def test_eval_rows_side_by_side_per_kv_dtype(h2ochat_main, tiny_checkpoint, tmp_path):
    """eval --kv-dtype auto,int8,int4: a row of each policy and budget for each dtype, in one run; each
    record names its dtype as given, its slots and its bytes (a size budget: more int4 slots than int8,
    more int8 than float)."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    result = h2ochat_main("eval", "--text", str(text), "--model", str(tiny_checkpoint), "--tokens", "60",
                          "--policies", "full,h2o", "--budget", "8,6KiB", "--kv-dtype", "auto,int8,int4", "--json")
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)["results"]
    h2o = [r for r in records if r["policy"].startswith("h2o")]
    assert {r["kv_dtype"] for r in h2o} == {"auto", "int8", "int4"}
    for r in h2o:
        assert r["kv_slots"] == r["budget_slots"] and r["kv_bytes"] > 0
        assert r["perplexity"] is not None
    by_size = {r["kv_dtype"]: r for r in h2o if r["budget_slots"] != 8}
    assert by_size["auto"]["kv_slots"] < by_size["int8"]["kv_slots"] < by_size["int4"]["kv_slots"]
    assert all(r["kv_bytes"] <= 6 * 1024 for r in by_size.values())


def test_recall_takes_quantized_slots(h2ochat_main, tiny_checkpoint):
    """--recall with --kv-dtype int8 generates (the recall columns hold the layer's codes)."""
    assert h2ochat_main("generate", "hi", "--model", str(tiny_checkpoint), "-n", "2", "--recall", "8", "--page", "4",
                        "--budget", "32", "--kv-dtype", "int8").returncode == 0


def test_the_server_gauges_the_bytes_per_slot():
    """/metrics' kv_bytes_per_slot is the batch cache's (0 for a backend without a cache)."""
    from types import SimpleNamespace

    from h2ochat.serve.engine import _slot_bytes

    model = build_model("llama", seed=0)
    cache = CacheSettings(budget="8", kv_dtype="int4").build(model)
    forward(model, cache, torch.randint(3, 90, (1, 4)))
    heads, head_dim = attention_shape(model.config)
    assert _slot_bytes(SimpleNamespace(cache=cache)) == slot_bytes_by_hand("int4", heads, head_dim) * 2
    assert _slot_bytes(object()) == 0
