"""`h2ochat bench`: the baselines are what they claim to be, the synthetic context is consistent,
the report has the promised shape, and bad inputs are refused in one line."""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from conftest import build_model, random_ids
from cpu_routes import without_attention_kernel  # noqa: F401 (a fixture)
from lockstep import EvictionRecorder, lockstep
from h2ochat.measure import bench_context, bench_measure, bench_memory, bench_ops
from h2ochat.measure import benchmark as bm
from h2ochat.measure.bench_baseline import SlotsOnlyCache
from h2ochat.cli import app
from h2ochat.engine.generation import CacheSettings, forward
from h2ochat.sizes import parse_size



def test_slots_only_baseline_is_a_sliding_window(family):
    """The bookkeeping-free ring of C slots attends over the last C tokens (the new one included):
    the same as the local policy's C - 1 slots plus the new token."""
    model = build_model(family)
    slots = 7
    ring = bench_context.build_cache(model, "slots", slots, context=0, extra=0)
    assert isinstance(ring, SlotsOnlyCache)
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
    cache = bench_context.build_cache(model, variant, slots, context, extra=5)
    ids = random_ids(batch, 1)
    forward(model, cache, ids)
    cache.assume_seen(context, torch.Generator().manual_seed(0))
    held = slots if variant != "full" else context
    assert cache.get_seq_length() == context
    assert cache.longest_row_tokens() == context
    assert int(cache.position_ids(batch, 1)[0, 0]) == context
    for layer in cache.layers:
        assert layer.slots_in_use == held
        assert bool((layer.token_index[:, :, :held] == torch.arange(context - held, context)).all())
    logits = forward(model, cache, random_ids(batch, 1))
    assert torch.isfinite(logits).all()
    if variant == "h2o":
        assert cache.evicted_tokens() == batch * 2 * model.config.num_hidden_layers  # one per (seq, KV head)
    expected = bm.kv_bytes_per_slot(model) * batch * (slots if variant != "full" else context + 5)
    assert cache.kv_bytes() == expected


def test_measure_reports_budget_share_and_dynamic_cache():
    model = build_model("neox")
    memory = bench_memory.PeakMemory(torch.device("cpu"))
    per_slot = bm.kv_bytes_per_slot(model)
    common = dict(context=50, batch=2, slots=10, steps=2, warmup=1, memory=memory)
    h2o = bench_measure.measure(model, "h2o", **common)
    hf = bench_measure.measure(model, "hf", **common)
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
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1000") == 1000
    for bad in ("two gigs", "-1GiB", "0"):
        with pytest.raises(ValueError, match="--kv-memory"):
            parse_size(bad)
    assert bm.parse_ints("512, 1024,512", "--context") == [512, 1024]
    with pytest.raises(ValueError, match="--batch"):
        bm.parse_ints("4,x", "--batch")


def run(*args):
    # the h2o policy, whatever the default: these tests size budgets that fit its split (no sinks)
    result = CliRunner().invoke(app, ["bench", "--policy", "h2o", "--dtype", "float32", *args])
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


# -- launches and the compiled step ------------------------------------------------------------------

@pytest.fixture
def aot_eager(monkeypatch):
    """dynamo's capture without inductor's C++ code generation (minutes per graph on this CPU)."""
    from h2ochat.engine import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")


@pytest.mark.parametrize("variant", ["h2o", "slots"])
def test_compiled_step_equals_eager_after_a_synthetic_context(aot_eager, variant):
    """The bench's compiled h2o and slots steps (the ring writes at a device-side slot) give the
    eager logits and the same kept tokens, in lock step (tests/lockstep.py: an eviction that differs
    must be a tie, and the comparison stops there), without recompiling from one step to the next."""
    model = build_model("llama", seed=0)
    tokens = random_ids(2, 6).T.contiguous().unsqueeze(-1)  # [steps, batch, 1]
    caches, steps = [], []
    for compile in (False, True):
        cache = bench_context.prepared_cache(model, variant, tokens[0], context=40, slots=8, extra=6, policy="h2o",
                                  generator=torch.Generator().manual_seed(0))
        step, compiled = bench_context.decode_step(model, cache, compile)
        assert compiled == compile
        caches.append(cache)
        steps.append(lambda ids, step=step: step(ids.view(-1, 1)).reshape(2, -1))
    logits = [step(tokens[1]) for step in steps]  # the compiled one compiles (once per variant and shape)
    recorder = EvictionRecorder(caches[0])
    with torch._dynamo.config.patch(error_on_recompile=True), recorder.recording():
        compared = lockstep(*steps, logits[0], 4, recorder=recorder, caches=caches,
                            pick=lambda index, _: tokens[index + 2].view(-1))
    if compared == 4:
        for eager, compiled in zip(*(cache.layers for cache in caches)):
            assert (eager.slots_in_use, eager.tokens_fed_with_padding) == (compiled.slots_in_use, compiled.tokens_fed_with_padding)


@pytest.mark.usefixtures("without_attention_kernel")  # (the torch route's ops: the C kernel fuses the scoring)
def test_ops_per_layer_counted_from_the_profiler():
    model = build_model("llama")
    common = dict(context=30, batch=2, slots=8)
    h2o, slots = bench_ops.profile_ops(model, "h2o", **common), bench_ops.profile_ops(model, "slots", **common)
    for entry in (h2o, slots):
        assert entry["layers"] == 2 and not entry["compiled"]
        assert 0 < entry["attention_ops_per_layer"] < entry["step_ops_per_layer"]
        assert entry["step_ops"] == pytest.approx(entry["step_ops_per_layer"] * 2, abs=0.1)
    # the bookkeeping is what h2o runs beyond the ring: scoring, eviction, statistics
    assert h2o["attention_ops_per_layer"] > 4 * slots["attention_ops_per_layer"]
    assert h2o["step_ops"] - slots["step_ops"] == pytest.approx(
        2 * (h2o["attention_ops_per_layer"] - slots["attention_ops_per_layer"]), abs=0.1)


def test_bench_command_compile_json(tiny_checkpoint, aot_eager):
    code, out, err = run("--model", str(tiny_checkpoint), "--context", "20", "--batch", "2", "--steps", "2",
                         "--warmup", "0", "--kv-memory", "0", "--compile", "--json")
    assert code == 0, err
    report = json.loads(out)
    runs = {(r["policy"], r["compiled"]) for r in report["results"]}
    assert runs == {("h2o", False), ("slots", False), ("full", False), ("hf", False), ("h2o", True), ("slots", True)}
    assert all(r["compile_s"] > 0 for r in report["results"] if r["compiled"])
    (c,) = report["comparisons"]
    for key in ("bookkeeping_overhead", "bookkeeping_overhead_compiled", "compile_speedup", "compile_speedup_slots"):
        assert c[key] > 0
    ops = {(entry["policy"], entry["compiled"]): entry for entry in report["ops_per_layer"]}
    assert set(ops) == {("h2o", False), ("slots", False), ("h2o", True), ("slots", True)}
    assert ops[("h2o", False)]["attention_ops_per_layer"] > ops[("slots", False)]["attention_ops_per_layer"]
    assert ops[("h2o", True)]["attention_ops_per_layer"] is None  # a compiled step has no per-call range
    assert "ops_counting" in report
    assert bm.BenchPlan([20], [2], lambda n: 4, compile=True).compile


# -- --recall: the two-tier cache beside the same policy -------------------------------------------

def recall_settings(recall="8", page=4, selector="exact", every=1):
    return CacheSettings(policy="h2o", budget="16", recall=recall, page=page, selector=selector, recall_every=every)


@pytest.mark.parametrize("selector", ["exact", "int4"])
def test_synthetic_cold_fill_holds_every_token_the_hot_slots_do_not(family, seed, selector):
    """After the bench's synthetic context, each layer's cold store and digest hold exactly the
    context's tokens its hot slots do not (per sequence and KV head: nothing lost, nothing twice),
    and a decode step recalls from them."""
    model = build_model(family)
    generator = torch.Generator().manual_seed(seed)
    batch, slots, context = 2, 16, int(torch.randint(30, 50, (), generator=generator))
    settings = recall_settings(selector=selector)
    cache = bench_context.prepared_cache(model, bench_context.RECALL, random_ids(batch, 1, generator), context=context, slots=slots,
                              extra=3, policy="h2o", generator=generator, recall=settings)
    hot = 16 - 8
    for layer in cache.layers:
        held_hot = layer.token_index[:, :, :hot]
        assert bool((layer.token_index[:, :, hot:] == -1).all())  # nothing recalled before the first step
        assert bool((layer.tier.cold.held_tokens() == context - hot).all())
        assert bool((layer.tier.digest.count == context - hot).all())
        for row in range(batch):
            for head in range(layer.keys.shape[1]):
                cold = layer.tier.cold.token_index[row, head]
                cold = sorted(cold[cold >= 0].tolist())
                in_hot = set(held_hot[row, head].tolist())
                assert cold == [t for t in range(context) if t not in in_hot]  # each exactly once
        if selector == "exact":  # the digest is the cold keys themselves
            slots = slice(0, layer.tier.cold.capacity)  # (the cold store's spill slot is not a slot)
            stored = layer.tier.cold.token_index[:, :, slots] >= 0
            torch.testing.assert_close(layer.tier.digest.codes[:, :, slots][stored], layer.tier.cold.keys[:, :, slots][stored])
    logits = forward(model, cache, random_ids(batch, 1, generator))
    assert torch.isfinite(logits).all()
    staging = hot + 8 - 4  # the last page of the recall columns stages the step's victim (issue 24)
    for layer in cache.layers:  # one frame of 4 recalled (a page of cold tokens), one staging page
        for row in range(batch):
            for head in range(layer.keys.shape[1]):
                recalled = layer.token_index[row, head, hot:staging]
                staged = layer.token_index[row, head, staging:]
                cold = set(layer.tier.cold.token_index[row, head].tolist()) - {-1}
                assert int((recalled >= 0).sum()) >= 1
                assert set(recalled[recalled >= 0].tolist()) <= cold
                # the victim of the decode step: evicted from the hot slots, not cold yet
                victims = set(staged[staged >= 0].tolist())
                assert len(victims) == 1 and not victims & cold
                assert not victims & set(layer.token_index[row, head, :hot].tolist())


def test_recall_step_time_is_the_median_block_mean():
    """With --recall-every k a step costs its share of one recall: the median over blocks of k steps
    of their mean, not the median step (which would miss the recall)."""
    steps = [10.0, 1.0, 1.0, 1.0] * 3 + [30.0, 1.0, 1.0, 1.0]
    timed = bench_measure.Measurement("recall", 100, 1, 16, 0, steps, block=4, step_cpu_ms=[2 * ms for ms in steps])
    assert timed.median_ms == pytest.approx(13 / 4) and timed.cpu_ms == pytest.approx(13 / 2)
    assert dataclasses.replace(timed, block=1).median_ms == 1.0
    assert bench_measure.Measurement("h2o", 100, 1, 16, 0, steps).cpu_ms is None  # not timed on the CPU
    assert bm.BenchPlan([100], [1], lambda n: 16, steps=5, recall=recall_settings(every=4)).steps == 8


def test_recall_targets():
    assert [bm.recall_target(n) for n in (100, 2048, 2049, 8192, 8193)] == [1.15, 1.15, 1.25, 1.25, None]


def test_bench_command_recall_rows_and_overhead(tiny_checkpoint):
    code, out, err = run("--model", str(tiny_checkpoint), "--context", "30,40", "--batch", "1,2", "--budget", "16",
                         "--recall", "0.5", "--page", "4", "--selector", "int4", "--recall-every", "2",
                         "--variants", "h2o,slots", "--steps", "2", "--warmup", "0", "--kv-memory", "0", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["recall"] == "0.5"
    by_point = {}
    for r in report["results"]:
        by_point.setdefault((r["context"], r["batch"]), {})[r["policy"]] = r
    assert set(by_point) == {(c, b) for c in (30, 40) for b in (1, 2)}
    overhead = {(c["context"], c["batch"]): c for c in report["recall_overhead"]}
    assert set(overhead) == set(by_point)
    per_token = report["kv_bytes_per_token"]
    for point, rows in by_point.items():
        h2o, recall = rows["h2o"], rows["recall"]
        assert set(rows) == {"h2o", "recall", "slots"}
        assert h2o["kv_slots"] == recall["kv_slots"] == 16  # the same device slots
        assert h2o["kv_bytes"] == recall["kv_bytes"] == per_token * point[1] * 16
        assert "recall" not in h2o and recall["recall"]["recall_slots"] == 8
        c = overhead[point]
        for key in ("ms_per_step", "recall_ms_per_step", "ratio", "target", "met", "digest_device_bytes",
                    "cold_host_bytes", "device_slots", "recall_slots", "selector", "every", "page"):
            assert key in c, key
        assert (c["ms_per_step"], c["recall_ms_per_step"]) == (h2o["ms_per_step"], recall["ms_per_step"])
        # the ratio is that of their steps run side by side; the turns' medians' ratio beside it
        assert c["turns_ratio"] == pytest.approx(c["recall_ms_per_step"] / c["ms_per_step"], abs=2e-3)
        side = c["side_by_side"]
        assert side["variants"] == ["h2o", "recall"] and side["block"] == 4  # (lcm of --recall-every 2, --page 4)
        assert side["steps"] == 4 and (side["ratio"], side["cpu_ratio"]) == (c["ratio"], c["cpu_ratio"])
        assert c["target"] == 1.15 and c["met"] == (c["cpu_ratio"] <= 1.15)  # (on a CPU: CPU time decides)
        assert (c["device_slots"], c["recall_slots"], c["selector"], c["every"], c["page"]) == (16, 8, "int4", 2, 4)
        assert c["digest_device_bytes"] > 0 and c["cold_host_bytes"] > 0
        assert c["turns_cpu_ratio"] == pytest.approx(c["recall_cpu_ms_per_step"] / c["cpu_ms_per_step"], abs=2e-3)
        assert (c["cpu_ms_per_step"], c["recall_cpu_ms_per_step"]) == (h2o["cpu_ms_per_step"], recall["cpu_ms_per_step"])
    assert [entry["policy"] for entry in report["ops_per_layer"]] == ["h2o", "recall", "slots"]


def test_a_paired_ratio_is_the_median_block_ratio_of_sums():
    """Side by side, the ratio is read block by block (a block's second-variant sum over its first-variant sum) and the
    median block's is taken: a slow block of both (the machine slowed) moves nothing, as a ratio of the two medians
    of separate turns would be moved by a slow turn of one."""
    first = [10.0, 10.0, 20.0, 20.0, 10.0, 10.0]
    second = [11.0, 11.0, 22.0, 22.0, 13.0, 13.0]
    paired = bench_measure.Paired(("h2o", "recall"), (first, second), (first, [x * 2 for x in second]), block=2)
    blocks = [sum(second[i:i + 2]) / sum(first[i:i + 2]) for i in (0, 2, 4)]
    assert paired.ratio() == pytest.approx(sorted(blocks)[1]) == pytest.approx(1.1)
    assert paired.ratio(cpu=True) == pytest.approx(2.2)
    assert bench_measure.Paired(("h2o", "recall"), (first, second), ([], []), block=2).ratio(cpu=True) is None
    assert paired.record() == {"variants": ["h2o", "recall"], "steps": 6, "block": 2, "ratio": 1.1, "cpu_ratio": 2.2}


def test_paired_steps_alternate_which_variant_goes_first(monkeypatch):
    """Each variant steps on its own cache, the two in turn, neither always first (a b, b a, a b, ...), and every
    step after the warm-up is timed for both."""
    model = build_model("llama")
    order = []
    made = bench_measure.decode_step

    def recording(model, cache, compile=False):
        step, compiled = made(model, cache, compile)
        name = "recall" if cache.tier.columns else "h2o"
        return (lambda ids: (order.append(name), step(ids))[1]), compiled

    monkeypatch.setattr(bench_measure, "decode_step", recording)
    settings = bm_recall_settings()
    paired = bench_measure.measure_paired(model, ("h2o", "recall"), context=40, batch=1, slots=16, steps=4, warmup=1,
                                          recall=settings, block=2)
    assert order == ["h2o", "recall", "recall", "h2o"] * 2 + ["h2o", "recall"]
    assert [len(ms) for ms in paired.step_ms] == [len(ms) for ms in paired.step_cpu_ms] == [4, 4]


def bm_recall_settings():
    from h2ochat.options import cache_settings

    return cache_settings("h2o", "16", None, None, "absolute", None, recall="0.5", page=4)


def test_bench_recall_zero_is_no_recall(tiny_checkpoint):
    """--recall 0 turns recall off (as in run, story and generate): h2o alone, no recall rows."""
    code, out, err = run("--model", str(tiny_checkpoint), "--context", "40", "--batch", "1", "--budget", "16",
                         "--recall", "0", "--variants", "h2o", "--steps", "1", "--warmup", "0", "--kv-memory", "0",
                         "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["recall"] is None and {r["policy"] for r in report["results"]} == {"h2o"}


def test_bench_command_recall_table(tiny_checkpoint):
    code, out, err = run("--model", str(tiny_checkpoint), "--context", "40", "--batch", "1", "--budget", "16",
                         "--recall", "8", "--page", "4", "--variants", "h2o", "--steps", "1", "--warmup", "0",
                         "--kv-memory", "0")
    assert code == 0, err
    assert "Recall overhead" in out and "recall" in out


@pytest.mark.parametrize("args, message", [
    (["--recall", "many"], "--recall"),
    (["--recall", "16"], "--recall 16"),  # all of the budget's slots
    (["--recall", "8", "--page", "3"], "--page"),
    (["--recall", "8", "--page", "4", "--selector", "int9"], "int9"),
    (["--recall", "8", "--page", "4", "--policy", "full"], "evicts"),
    (["--recall", "8", "--page", "4", "--variants", "slots"], "h2o"),
    (["--variants", "h2o,bogus"], "--variants"),
])
def test_bench_command_refuses_bad_recall_settings(tiny_checkpoint, args, message):
    code, out, err = run("--model", str(tiny_checkpoint), "--context", "40", "--budget", "16", "--steps", "1", *args)
    assert code == 2, out
    last = err.strip().splitlines()[-1]
    assert last.startswith("h2ochat: error:") and message in last, last
    assert "Traceback" not in out + err


def test_bench_command_recall_compiled(tiny_checkpoint, aot_eager):
    """--compile with --recall (every step): recall compiled beside h2o compiled, and an overhead entry
    for the eager pair and one for the compiled pair."""
    code, out, err = run("--model", str(tiny_checkpoint), "--context", "40", "--batch", "1", "--budget", "16",
                         "--recall", "8", "--page", "4", "--variants", "h2o", "--steps", "2", "--warmup", "0",
                         "--kv-memory", "0", "--compile", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert {(r["policy"], r["compiled"]) for r in report["results"]} == {
        ("h2o", False), ("recall", False), ("h2o", True), ("recall", True)}
    assert [c["compiled"] for c in report["recall_overhead"]] == [False, True]
    assert bm.BenchPlan([40], [1], lambda n: 16, compile=True, recall=recall_settings(every=2)).compilable().count(
        bench_context.RECALL)  # the pages are chosen before the step, at any cadence: compiled too


def test_bench_budget_as_a_size_is_the_slots_that_fit(tiny_checkpoint):
    """--budget 4KiB: h2o runs the slots whose KV bytes fit (as generate's cache would), at most that."""
    from transformers import AutoConfig

    code, out, err = run("--model", str(tiny_checkpoint), "--context", "40", "--batch", "1", "--budget", "4KiB",
                         "--variants", "h2o", "--steps", "1", "--warmup", "0", "--kv-memory", "0", "--json")
    assert code == 0, err
    h2o = [r for r in json.loads(out)["results"] if r["policy"] == "h2o"]
    want = CacheSettings(budget="4KiB").slots(AutoConfig.from_pretrained(tiny_checkpoint))
    assert h2o and all(r["kv_slots"] == want and r["kv_bytes"] <= 4096 for r in h2o)


def test_bench_recall_with_capacity_runs_and_repeats(tiny_checkpoint):
    """--recall with the --kv-memory capacity rows and --repeats 3: the capacity rows (no recall, 4
    steps) are timed step by step, not in blocks of --page 8 steps of which their 4 steps hold none (a
    `no median for empty data` traceback before, as at the default page of 16)."""
    code, out, err = run("--model", str(tiny_checkpoint), "--context", "40", "--batch", "1", "--budget", "24",
                         "--recall", "16", "--page", "8", "--variants", "h2o", "--steps", "2", "--warmup", "0",
                         "--repeats", "3", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["capacity"] and all(entry["decode_tokens_per_s"] for entry in report["capacity"])
    assert {r["policy"] for r in report["results"]} == {"h2o", "recall"}


_STEP_TEMPORARIES = """
import ctypes, torch
from h2ochat.measure.bench_memory import PeakMemory
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
memory = PeakMemory(torch.device("cpu"))
memory.reset()
mapped = 0
for _ in range(10):  # a step's temporary, made and freed at every step
    before = libc.mallinfo2().hblks
    temporary = torch.empty(1 << 20, dtype=torch.uint8)
    mapped += libc.mallinfo2().hblks > before
    del temporary
print(mapped)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_the_memory_probe_leaves_the_allocator_as_the_product_runs_it():
    """``bench`` measured its steps with glibc's mmap threshold fixed at 256 KiB (to keep one measurement's
    freed tensors out of the next one's RSS): every larger temporary was then a fresh mapping, its pages
    faulted in at every step (int8 slots at 8 rows timed 3.5x slower than they run). After a reset, a 1 MiB
    temporary made and freed ten times is a mapping of its own once at most, as in ``generate``."""
    run = subprocess.run([sys.executable, "-c", _STEP_TEMPORARIES], capture_output=True, text=True, check=True)
    assert int(run.stdout.split()[-1]) <= 1
