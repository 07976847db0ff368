"""`h2ochat bench`: the baselines are what they claim to be, the synthetic context is consistent,
the report has the promised shape, and bad inputs are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import build_model, random_ids
from h2ochat import benchmark as bm
from h2ochat.cli import app
from h2ochat.generation import CacheSettings, forward



def test_slots_only_baseline_is_a_sliding_window(family):
    """The bookkeeping-free ring of C slots attends over the last C tokens (the new one included):
    the same as the local policy's C - 1 slots plus the new token."""
    model = build_model(family)
    slots = 7
    ring = bm.build_cache(model, "slots", slots, context=0, extra=0)
    assert not ring.bookkeeping
    window = CacheSettings(policy="local", budget=str(slots - 1), positions="absolute").build(model)
    ids = random_ids(2, 30)
    for i in range(ids.shape[1]):
        torch.testing.assert_close(forward(model, ring, ids[:, i : i + 1]), forward(model, window, ids[:, i : i + 1]),
                                   atol=1e-5, rtol=1e-5, msg=f"step {i}")
    assert ring.kv_bytes() == window.kv_bytes() * slots // (slots - 1)


@pytest.mark.parametrize("variant", ["h2o", "slots", "full"])
def test_synthetic_context_looks_fed(variant):
    model = build_model("llama")
    context, slots, batch = 40, 8, 3
    cache = bm.build_cache(model, variant, slots, context, extra=5)
    ids = random_ids(batch, 1)
    forward(model, cache, ids)
    bm.fill_synthetic(cache, context, torch.Generator().manual_seed(0))
    held = slots if variant != "full" else context
    assert cache.get_seq_length() == context
    assert cache.tokens_seen() == context
    assert int(cache.position_ids(batch, 1)[0, 0]) == context
    for layer in cache.layers:
        assert layer.used == held
        assert bool((layer.token_index[:, :, :held] == torch.arange(context - held, context)).all())
    logits = forward(model, cache, random_ids(batch, 1))
    assert torch.isfinite(logits).all()
    if variant == "h2o":
        assert cache.evicted_tokens() == batch * 2 * model.config.num_hidden_layers  # one per (seq, KV head)
    expected = bm.kv_bytes_per_slot(model) * batch * (slots if variant != "full" else context + 5)
    assert cache.kv_bytes() == expected


def test_measure_reports_budget_share_and_dynamic_cache():
    model = build_model("neox")
    memory = bm.PeakMemory(torch.device("cpu"))
    per_slot = bm.kv_bytes_per_slot(model)
    common = dict(context=50, batch=2, slots=10, steps=2, warmup=1, memory=memory)
    h2o = bm.measure(model, "h2o", **common)
    hf = bm.measure(model, "hf", **common)
    assert h2o.kv_bytes == per_slot * 2 * 10
    assert hf.kv_slots == 50 + 3 and hf.kv_bytes == per_slot * 2 * 53
    assert len(h2o.step_ms) == 2 and h2o.decode_tokens_per_s > 0 and h2o.peak_memory_bytes > 0
    assert model.config._attn_implementation == "h2o"  # switched back after the hf run


def test_ideal_speedup_and_capacity():
    assert bm.ideal_speedup(100, 1, batch=2, context=100, slots=20) == pytest.approx(300 / 140)
    assert bm.capacity_batch("h2o", kv_memory=1000, per_slot=10, context=100, slots=20, extra=0) == 5
    assert bm.capacity_batch("full", kv_memory=1000, per_slot=10, context=100, slots=20, extra=0) == 1
    assert bm.capacity_batch("hf", kv_memory=999, per_slot=10, context=100, slots=20, extra=0) == 0


def test_parse_size_and_lists():
    assert bm.parse_size("2GiB") == 2 * 2**30
    assert bm.parse_size("512 MiB") == 512 * 2**20
    assert bm.parse_size("1.5GB") == 1_500_000_000
    assert bm.parse_size("1000") == 1000
    for bad in ("two gigs", "-1GiB", "0"):
        with pytest.raises(ValueError, match="--kv-memory"):
            bm.parse_size(bad)
    assert bm.parse_ints("512, 1024,512", "--context") == [512, 1024]
    with pytest.raises(ValueError, match="--batch"):
        bm.parse_ints("4,x", "--batch")


def run(*args):
    result = CliRunner().invoke(app, ["bench", *args])
    return result.exit_code, result.stdout, result.stderr


def test_bench_command_json(tiny_checkpoint):
    code, out, err = run("--model", str(tiny_checkpoint), "--context", "20,30", "--batch", "1,2", "--budget", "0.2",
                         "--steps", "2", "--warmup", "0", "--kv-memory", "64KiB", "--max-batch", "4", "--json")
    assert code == 0, err
    report = json.loads(out)
    keys = {"policy", "context", "batch", "kv_slots", "kv_bytes", "decode_tokens_per_s", "peak_memory_bytes"}
    assert len(report["results"]) == 2 * 2 * 4
    assert all(keys <= set(r) for r in report["results"])
    assert {r["policy"] for r in report["results"]} == {"h2o", "slots", "full", "hf"}
    assert len(report["comparisons"]) == 4
    for c in report["comparisons"]:
        assert {"context", "batch", "ideal_speedup", "speedup_vs_full", "speedup_vs_hf", "bookkeeping_overhead"} <= set(c)
        assert c["kv_slots"] == round(0.2 * c["context"]) and c["kv_share"] == pytest.approx(c["kv_slots"] / c["context"], abs=1e-4)
        assert c["ideal_speedup"] > 1
    per_token = report["kv_bytes_per_token"]
    for c in report["capacity"]:
        held = c["context"] + 3 if c["policy"] != "h2o" else round(0.2 * c["context"])
        assert c["max_batch"] == 64 * 1024 // (per_token * held)
        assert c["measured_batch"] == min(c["max_batch"], 4)


def test_bench_command_table(tiny_checkpoint):
    code, out, err = run("--model", str(tiny_checkpoint), "--context", "20", "--batch", "2", "--steps", "1",
                         "--warmup", "0", "--kv-memory", "0", "--repeats", "2")
    assert code == 0, err
    assert "bookkeeping" in out and "hf" in out


@pytest.mark.parametrize("args, message", [
    (["--context", "100"], "position limit"),
    (["--kv-memory", "lots"], "--kv-memory"),
    (["--batch", "0"], "--batch"),
    (["--budget", "abc"], "--budget"),
])
def test_bench_command_refuses_bad_inputs(tiny_checkpoint, args, message):
    code, out, err = run("--model", str(tiny_checkpoint), "--steps", "1", *args)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("h2ochat: error:") and message in last
    assert "Traceback" not in out + err
