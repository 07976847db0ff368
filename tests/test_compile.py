"""A decode step fit for a GPU: static shapes equal to the default path, no host reads inside the
step, the stop check read back every k tokens, and the compiled step (``--compile``) equal to eager
with one graph per model and shape: fullgraph, no recompiles as the cache grows, fills, re-numbers
or is replaced.

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
from h2ochat import compiled
from h2ochat.cache import H2OCache
from h2ochat.cli import app
from h2ochat.generation import CacheSettings, Sampling, forward, stream

BUDGET = "8"  # slots per layer; prompts of 5 tokens grow the cache, 12 fill it in the prefill


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")


@pytest.fixture(scope="module")
def models():
    """One model per family for the whole module: compiled graphs are keyed by the model's guards,
    so the tests share them."""
    return {family: build_model(family, seed=0) for family in FAMILIES}


def kept(cache: H2OCache) -> list[torch.Tensor]:
    """Per layer, each (sequence, head)'s held token indices in order (slot order aside)."""
    return [layer.token_index.sort(dim=-1).values for layer in cache.layers]


def generate(model, ids, *, static=False, compile=False, tokens=12, policy="h2o", mask=None, **kwargs):
    cache = CacheSettings(policy=policy, budget=BUDGET).build(model, static_shapes=static)
    steps = list(stream(model, cache, ids, mask, max_new_tokens=tokens, compile=compile, **kwargs))
    return torch.stack([s.tokens for s in steps]), cache


def assert_same_run(a, b):
    (tokens_a, cache_a), (tokens_b, cache_b) = a, b
    assert torch.equal(tokens_a, tokens_b)
    for layer_a, layer_b, held_a, held_b in zip(cache_a.layers, cache_b.layers, kept(cache_a), kept(cache_b)):
        assert torch.equal(held_a, held_b)
        assert (layer_a.slots_in_use, layer_a.tokens_fed_with_padding) == (layer_b.slots_in_use, layer_b.tokens_fed_with_padding)
        assert torch.equal(layer_a.evicted, layer_b.evicted)
        torch.testing.assert_close(layer_a.evicted_share, layer_b.evicted_share)
    assert cache_a.largest_next_position == cache_b.largest_next_position


# -- static shapes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_static_shapes_equal_the_default_path(models, family, policy):
    """Attending over all C slots and always evicting in place keeps the same tokens as slicing to
    the used slots, while the cache grows, once it is full, and with left padding."""
    model = models[family]
    ids = random_ids(2, 5, torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # row 1 is left-padded: padding slots, then filled in place
    for prompt, attention in ((ids, None), (ids, mask), (random_ids(2, 12), None)):
        assert_same_run(generate(model, prompt, policy=policy, mask=attention),
                        generate(model, prompt, static=True, policy=policy, mask=attention))


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
    """Compiled decode (fullgraph) gives the eager tokens and kept slots, for a cache that grows
    then evicts, and for one full from the prefill; after the first compile, neither the growth, the
    steady state, a new cache nor a left-padded prompt compiles again."""
    model = models[family]
    ids = random_ids(2, 5, torch.Generator().manual_seed(4))
    before = counters["stats"]["unique_graphs"]
    first = generate(model, ids, compile=True)  # compiles (unless an earlier test did)
    assert counters["stats"]["unique_graphs"] - before <= 1
    assert_same_run(generate(model, ids), first)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt, attention in ((ids, None), (random_ids(2, 12), None), (ids, mask)):
            assert_same_run(generate(model, prompt, mask=attention),
                            generate(model, prompt, mask=attention, compile=True))


def test_compiled_decode_runs_past_the_position_limit(models):
    """Compact positions: the re-numbering happens outside the graph, in place, and the graph
    carries on without recompiling (the tiny models have 64 positions)."""
    model = models["llama"]
    ids = random_ids(2, 12, torch.Generator().manual_seed(5))
    generate(model, ids, compile=True, tokens=2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        eager, compiled_run = generate(model, ids, tokens=70), generate(model, ids, tokens=70, compile=True)
    assert compiled_run[1].compactions == eager[1].compactions >= 1
    assert_same_run(eager, compiled_run)


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
    ["generate", "--raw", "-n", "6", "--budget", "8", "--json", "once upon a time"],
    ["story", "--prompt", "once upon a time", "--tokens", "6", "--budget", "8", "--seed", "1", "--json"],
])
def test_commands_take_compile(tiny_checkpoint, command):
    """--compile on generate and story: the same text and cache statistics as eager."""
    runner = CliRunner()
    args = [*command, "--model", str(tiny_checkpoint)]
    eager = runner.invoke(app, args)
    compiled_run = runner.invoke(app, [*args, "--compile"])
    assert eager.exit_code == 0, eager.output
    assert compiled_run.exit_code == 0, compiled_run.output
    assert _content(eager.stdout) == _content(compiled_run.stdout)


def _content(out: str):
    record = json.loads(out)
    texts = record["text"] if "text" in record else [story["text"] for story in record["stories"]]
    return texts, record["cache_stats"]


def test_chat_takes_compile(tiny_checkpoint):
    """run --compile: a Conversation decoding through the compiled step replies as an eager one,
    over two turns on the same cache."""
    from h2ochat.chat import ChatSettings, Conversation
    from h2ochat.models import load

    loaded = load(str(tiny_checkpoint), "cpu", "float32")
    replies = {}
    for compile in (False, True):
        settings = ChatSettings(temperature=0.0, max_new_tokens=6, cache=CacheSettings(budget=BUDGET))
        conversation = Conversation(loaded.model, loaded.tokenizer, settings, compile=compile)
        replies[compile] = [conversation.send(text).text for text in ("hello", "tell me more")]
        replies[compile].append(kept(conversation.cache))
    assert replies[False][:2] == replies[True][:2]
    assert all(torch.equal(a, b) for a, b in zip(replies[False][2], replies[True][2]))


def test_compiled_decode_with_inductor():
    """The real backend, generated C++ and all, on a one-layer Llama (GQA): the tokens and kept
    slots of eager. (Minutes of compilation on a loaded 2-core machine for two layers; one is enough
    to run every kernel kind once.)"""
    model = build_model("llama", seed=6, num_hidden_layers=1)
    ids = random_ids(2, 5, torch.Generator().manual_seed(7))
    decoder = compiled.CompiledDecode(model, backend="inductor")
    runs = {}
    for compile in (False, True):
        cache = CacheSettings(budget=BUDGET).build(model, static_shapes=True)
        logits = forward(model, cache, ids, logits_to_keep=1)[:, -1]
        tokens = []
        for _ in range(10):  # grows from 5 to 8 slots, then evicts
            token = logits.argmax(-1)
            tokens.append(token)
            logits = decoder(cache, token) if compile else forward(model, cache, token[:, None])[:, -1]
        runs[compile] = (torch.stack(tokens), cache, logits)
    assert_same_run(runs[False][:2], runs[True][:2])
    torch.testing.assert_close(runs[False][2], runs[True][2], atol=1e-4, rtol=1e-4)
