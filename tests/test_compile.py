"""A decode step fit for a GPU: static shapes equal to the default path, no host reads inside the
step, the stop check read back every k tokens, and the compiled step (``--compile``) equal to eager
with one graph per model and shape: fullgraph, no recompiles as the cache grows, fills, re-numbers
or is replaced.

Two implementations are compared in lock step (``tests/lockstep.py``): both are fed the same tokens,
their logits compared within a tolerance and their kept tokens after every step, an eviction that
differs accepted only between two candidates whose priorities tie (the comparison stops there).
Comparing their own greedy tokens would let a near-tie between two logits decide the outcome.

Most compiled tests use dynamo's ``aot_eager`` backend: the same capture inductor gets (fullgraph,
guards, functionalised in-place updates of the cache) without the C++ code generation, which takes
minutes per graph on this CPU; one test runs inductor itself, on a one-layer model.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from conftest import FAMILIES, build_model, random_ids
from h2ochat.engine import compiled
from h2ochat.cli import app
from h2ochat.engine.generation import CacheSettings, Sampling, Timing, forward, prefill, stream
from lockstep import EvictionRecorder, kept_agree_or_tie, lockstep

BUDGET = "8"  # slots per layer; prompts of 5 tokens grow the cache, 12 fill it in the prefill


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")


@pytest.fixture(scope="module")
def models():
    """One model per family for the whole module: compiled graphs are keyed by the model's guards,
    so the tests share them."""
    return {family: build_model(family, seed=0) for family in FAMILIES}


def generate(model, ids, *, static=False, compile=False, tokens=12, policy="h2o", mask=None, **kwargs):
    cache = CacheSettings(policy=policy, budget=BUDGET).build(model, static_shapes=static)
    steps = list(stream(model, cache, ids, mask, max_new_tokens=tokens, compile=compile, **kwargs))
    return torch.stack([s.tokens for s in steps]), cache




def assert_same_counters(cache_a, cache_b):
    for layer_a, layer_b in zip(cache_a.layers, cache_b.layers):
        assert (layer_a.slots_in_use, layer_a.tokens_fed_with_padding) == (layer_b.slots_in_use, layer_b.tokens_fed_with_padding)
        assert torch.equal(layer_a.evicted, layer_b.evicted)
        torch.testing.assert_close(layer_a.evicted_share, layer_b.evicted_share)
    assert cache_a.largest_next_position == cache_b.largest_next_position
    assert torch.equal(cache_a.next_position, cache_b.next_position)


def eager_step(model, cache):
    return lambda tokens: forward(model, cache, tokens[:, None], logits_to_keep=1)[:, -1]


def compare(model, prompt, mask=None, *, policy="h2o", steps=12, static=(False, False), compile=(False, True),
            decoder=None, atol=1e-5):
    """Prefill ``prompt`` into two caches (static shapes or not), then decode ``steps`` tokens in
    lock step, eager or compiled each. Returns the caches and the steps compared before an
    eviction tie made them diverge (after one, their counters are not compared)."""
    caches, logits, steppers = [], [], []
    for is_static, is_compiled in zip(static, compile):
        cache = CacheSettings(policy=policy, budget=BUDGET).build(model, static_shapes=is_static)
        logits.append(prefill(model, cache, prompt, mask))
        caches.append(cache)
        if is_compiled:
            step = decoder or compiled.CompiledDecode(model)
            steppers.append(lambda tokens, cache=cache, step=step: step(cache, tokens))
        else:
            steppers.append(eager_step(model, cache))
    torch.testing.assert_close(logits[1], logits[0], atol=atol, rtol=atol)
    # a prefill that evicts runs the same code in both unless static shapes differ: those prompts fit
    assert kept_agree_or_tie(*caches, None, "after the prefill")
    recorder = EvictionRecorder(caches[0])  # the first run is eager
    with recorder.recording():
        compared = lockstep(*steppers, logits[0], steps, atol=atol, rtol=atol, recorder=recorder, caches=caches)
    if compared == steps:
        assert_same_counters(*caches)
    return caches, compared


# -- static shapes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_static_shapes_equal_the_default_path(models, family, policy):
    """Attending over all C slots and always evicting in place keeps the same tokens as slicing to
    the used slots, while the cache grows, once it is full, and with left padding. (Prompts up to
    the budget: a prefill that evicts would let two differently rounded sums decide its choice.)"""
    model = models[family]
    ids = random_ids(2, 5, torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # row 1 is left-padded: padding slots, then filled in place
    for prompt, attention in ((ids, None), (ids, mask), (random_ids(2, 8), None)):
        compare(model, prompt, attention, policy=policy, static=(False, True), compile=(False, False))


# -- host reads ------------------------------------------------------------------------------------

class HostReads(TorchDispatchMode):
    """Counts the aten ops that bring a tensor's value to the host (``.item()``, ``bool(t)``,
    ``.tolist()`` and data-dependent shapes all end in one of these)."""

    READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
             "aten::repeat_interleave", "aten::equal", "aten::is_nonzero")

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().split(".")[0]
        boolean_index = name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))
        if name in self.READS or boolean_index:  # a boolean index finds its True entries on the host
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def python_reads(log: list):
    """Counts Python-level reads of a tensor's value (item, tolist, bool, int, float, index)."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            log.append(name)
            return original(self, *args, **kwargs)
        return wrapper

    for name, original in saved.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("static", [False, True])
def test_a_decode_step_reads_nothing_back(models, family, static):
    """One decode forward (positions, every layer's attention, scoring, eviction, statistics) of a
    growing and of a full cache: no value comes back to the host."""
    model = models[family]
    for prompt_len in (3, 12):  # growing, full
        cache = CacheSettings(budget=BUDGET).build(model, static_shapes=static)
        forward(model, cache, random_ids(2, prompt_len))
        forward(model, cache, random_ids(2, 1))
        token = random_ids(2, 1)
        log: list[str] = []
        with python_reads(log), HostReads() as mode:
            forward(model, cache, token, logits_to_keep=1)
        assert log == [] and mode.reads == [], (prompt_len, log, mode.reads)


def test_stop_check_read_back_every_k_tokens(models):
    """stop_check_every=k: one read-back per k tokens instead of per token, the same tokens yielded
    (a stop inside a burst ends the stream there)."""
    model = models["llama"]
    ids = random_ids(2, 4, torch.Generator().manual_seed(2))
    sampling = Sampling(temperature=1.0, seed=3)
    free, _ = generate(model, ids, tokens=24, sampling=sampling)
    stop = int(free[5, 0])  # row 0 stops at step 5 (or before); row 1 when it writes it too, or never
    stops = {stop, int(free[9, 1])}
    exact, _ = generate(model, ids, tokens=24, sampling=sampling, stop_ids=stops)
    assert len(exact) <= 10
    for k in (2, 4, 7, 32):
        log: list[str] = []
        with python_reads(log):
            burst, _ = generate(model, ids, tokens=24, sampling=sampling, stop_ids=stops, stop_check_every=k)
        assert torch.equal(burst, exact), k
        assert log.count("tolist") <= -(-len(exact) // k) + 1 and "__bool__" not in log, (k, log)
    with pytest.raises(ValueError, match="stop_check_every"):
        generate(model, ids, stop_check_every=0)


# -- the compiled step -----------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decode_equals_eager_without_recompiling(models, family):
    """Compiled decode (fullgraph) gives the eager logits and kept slots, for a cache that grows
    then evicts, and for one full from the prefill; after the first compile, neither the growth, the
    steady state, a new cache nor a left-padded prompt compiles again."""
    model = models[family]
    ids = random_ids(2, 5, torch.Generator().manual_seed(4))
    before = counters["stats"]["unique_graphs"]
    compare(model, ids)  # compiles (unless an earlier test did)
    assert counters["stats"]["unique_graphs"] - before <= 1
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt, attention in ((ids, None), (random_ids(2, 12), None), (ids, mask)):
            compare(model, prompt, attention)


# every policy whose rank is a built-in formula compiles; random draws on the host and stays eager
# (test_caches_the_compiled_step_does_not_cover_run_eagerly)
@pytest.mark.parametrize("policy", ["mean", "decay", "tova", "local", "sink", "h2o:value_eps=0.05",
                                    "h2o:layer_shape=0.5", "decay:layer_shape=-0.4:sinks=1"])
def test_every_policy_compiles_and_equals_eager(models, policy):
    """Each policy's compiled step (its rank in the eviction, its decay in the attention, budgets per
    layer) against its eager step, on the GQA model, evicting from the first decode step."""
    model = models["llama"]
    ids = random_ids(2, 8, torch.Generator().manual_seed(8))
    (eager, compiled_cache), _ = compare(model, ids, policy=policy, steps=10)
    assert compiled_cache.static_shapes and not eager.static_shapes  # the compiled path ran
    assert eager.evicted_tokens() > 0


def test_compiled_with_stop_check_every_k(models):
    """Compiled, read back every 4 tokens: the tokens of a compiled run read back every token (the
    same graph, so the same numbers), stopping at the same step, and the same cache bit for bit: the
    finished rows and the steps queued after the stop feed nothing (the row mask is a graph input);
    the compiled step itself equals eager in lock step (the tests above)."""
    model = models["neox"]
    ids = random_ids(2, 6, torch.Generator().manual_seed(9))
    sampling = Sampling(temperature=1.0, seed=10)
    free, _ = generate(model, ids, tokens=16, sampling=sampling, compile=True)
    stops = {int(free[5, 0]), int(free[9, 1])}
    runs = {}
    for k in (1, 4):
        timing = Timing()
        tokens, cache = generate(model, ids, tokens=16, sampling=sampling, compile=True, stop_ids=stops,
                                 stop_check_every=k, timing=timing)
        runs[k] = (tokens, cache, timing)
    (tokens_1, cache_1, timing_1), (tokens_4, cache_4, timing_4) = runs[1], runs[4]
    assert torch.equal(tokens_1, tokens_4) and len(tokens_4) <= 10
    assert cache_4.static_shapes and timing_1.fed_past_stop == timing_4.fed_past_stop == 0
    for layer_1, layer_4 in zip(cache_1.layers, cache_4.layers):
        state_1, state_4 = layer_1.state_tensors(), layer_4.state_tensors()
        assert all(torch.equal(state_1[name], state_4[name]) for name in state_1)
    assert torch.equal(cache_1.tokens_fed, cache_4.tokens_fed) and torch.equal(cache_1.next_position, cache_4.next_position)
    assert cache_1.host_counters() == cache_4.host_counters()


def test_compiled_decode_runs_past_the_position_limit(models):
    """Compact positions: the re-numbering happens outside the graph, in place, and the graph
    carries on without recompiling (the tiny models have 64 positions)."""
    model = models["llama"]
    ids = random_ids(2, 12, torch.Generator().manual_seed(5))
    compare(model, ids, steps=2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        (eager, compiled_cache), compared = compare(model, ids, steps=70)
    if compared > 60:  # past the limit before any eviction tie
        assert compiled_cache.compactions == eager.compactions >= 1


def test_caches_the_compiled_step_does_not_cover_run_eagerly(models):
    model = models["opt"]
    ids = random_ids(1, 5)
    for policy in ("random", "full"):
        cache = CacheSettings(policy=policy, budget=BUDGET, seed=0).build(model)
        forward(model, cache, ids)
        assert compiled.unsupported(cache) is not None
        assert not compiled.CompiledDecode(model).prepare(cache)
    random_run = generate(model, ids, policy="random", tokens=10, compile=True)
    assert len(random_run[0]) == 10
    assert not random_run[1].static_shapes  # left as built: the eager path ran




@pytest.mark.parametrize("command", [
    ["generate", "--raw", "-n", "6", "--budget", "8", "--json", "--ignore-eos", "once upon a time"],
    ["story", "--prompt", "once upon a time", "--tokens", "6", "--budget", "8", "--seed", "1", "--json"],
])
def test_commands_take_compile(tiny_checkpoint, command):
    """--compile on generate and story: the same counts and cache figures that do not depend on which
    tokens were picked (the token-by-token equality with eager is the lock-step tests' job: here the
    greedy picks of two implementations could split on a near-tie)."""
    runner = CliRunner()
    args = [*command, "--model", str(tiny_checkpoint)]
    eager = runner.invoke(app, args)
    compiled_run = runner.invoke(app, [*args, "--compile"])
    assert eager.exit_code == 0, eager.output
    assert compiled_run.exit_code == 0, compiled_run.output
    assert _counts(eager.stdout) == _counts(compiled_run.stdout)


def _counts(out: str):
    record = json.loads(out)
    layers = [(layer["capacity"], layer["evicted_per_head"]) for layer in record["cache_stats"]["layers"]]
    return record.get("generated_tokens"), record.get("kv_bytes"), record.get("evicted_tokens"), layers


def test_chat_takes_compile(tiny_checkpoint):
    """run --compile: a Conversation decoding through the compiled step, over two turns on the same
    cache (the compiled path taken, the conversation and its cache in step)."""
    from h2ochat.chat.conversation import Conversation
    from h2ochat.chat.settings import ChatSettings
    from h2ochat.loading.models import load

    loaded = load(str(tiny_checkpoint), "cpu", "float32")
    settings = ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=6, cache=CacheSettings(budget=BUDGET))
    conversation = Conversation(loaded.model, loaded.tokenizer, settings, compile=True)
    conversation.stop_ids = set()  # every turn decodes its 6 tokens, whatever the random weights write
    for text in ("hello", "tell me more"):
        conversation.send(text)
    assert conversation.cache.static_shapes  # the compiled step prepared it
    assert conversation.cache.longest_row_tokens() == len(conversation.ids) > 2 * 6


def test_compiled_decode_with_inductor():
    """The real backend, generated C++ and all, on a one-layer Llama (GQA): the logits and kept
    slots of eager, in lock step. (Minutes of compilation on a loaded 2-core machine for two layers;
    one is enough to run every kernel kind once.)"""
    model = build_model("llama", seed=6, num_hidden_layers=1)
    ids = random_ids(2, 5, torch.Generator().manual_seed(7))
    decoder = compiled.CompiledDecode(model, backend="inductor")
    compare(model, ids, steps=10, static=(True, True), decoder=decoder, atol=1e-4)  # grows to 8 slots, then evicts


def test_lockstep_fails_on_a_difference_that_is_not_a_tie(models):
    """The lock-step comparison accepts a differing eviction only between tied candidates: a sliding
    window (its priorities are token indices, never within rounding of each other) against h2o,
    which keeps heavy hitters past the window, fails it."""
    model = models["llama"]
    ids = random_ids(2, 8, torch.Generator().manual_seed(11))
    caches = [CacheSettings(policy=policy, budget=BUDGET).build(model) for policy in ("local", "h2o")]
    logits = [prefill(model, cache, ids) for cache in caches]
    recorder = EvictionRecorder(caches[0])
    with recorder.recording(), pytest.raises(AssertionError, match="no tie|kept"):
        lockstep(eager_step(model, caches[0]), eager_step(model, caches[1]), logits[0], 20, atol=1e9, rtol=1e9,
                 recorder=recorder, caches=caches)


def test_weights_freeze_only_when_switched_on_on_the_cpu_with_room(monkeypatch):
    """Frozen weights are opt in (H2OCHAT_COMPILE_FREEZE=1), CPU only, and refused when the free memory
    cannot hold two packed copies per graph; the reason is said either way."""
    from h2ochat.loading.memory import config_parameters

    model = build_model("llama", seed=6, num_hidden_layers=1)
    cpu = torch.device("cpu")
    weights = 4 * config_parameters(model.config)  # fp32, counted from the configuration on the meta device
    monkeypatch.delenv(compiled.FREEZE_SWITCH, raising=False)
    assert compiled.freezes_weights(model, cpu) == (False, "weights not frozen (H2OCHAT_COMPILE_FREEZE=1 freezes them)")
    monkeypatch.setenv(compiled.FREEZE_SWITCH, "1")
    assert compiled.freezes_weights(model, torch.device("cuda"))[0] is False
    monkeypatch.setattr(compiled, "free_host_bytes", lambda: 2 * 3 * weights)
    assert compiled.freezes_weights(model, cpu, graphs=3)[0] is True
    frozen, why = compiled.freezes_weights(model, cpu, graphs=4)
    assert not frozen and "4 frozen copies" in why
    decoder = compiled.CompiledDecode(model, backend="aot_eager")
    assert decoder.frozen is False and decoder.freezing == "backend aot_eager"
