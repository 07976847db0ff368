"""The recall decode step without host reads: eager (no value read back, counted op by op) and
compiled (fullgraph capture with dynamo's aot_eager backend, equal to eager bit for bit over steps
that evict, recall and re-number)."""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.utils import counters
from conftest import FAMILIES, VOCAB, build_model

from h2ochat.engine import compiled
from h2ochat.engine.forward_step import forward
from conftest import recall_cache
from h2ochat.recall.tiered import RecallConfig
from h2ochat.rotary import find_rotary
from test_compile import HostReads, python_reads

HOT, RECALL, PAGE, LIMIT = 12, 8, 4, 64


@pytest.fixture(scope="module")
def models():
    return {family: build_model(family, seed=0) for family in FAMILIES}  # 64 positions


def _cache(model, *, selector="int4", every=1, static=True, cold_dtype="same", rule="in-step"):
    return recall_cache(model.config.num_hidden_layers, "h2o", HOT,
                       recall=RecallConfig(RECALL, PAGE, selector, cold_dtype=cold_dtype, every=every, decode_rule=rule),
                       max_positions=LIMIT, rotary=find_rotary(model), static_shapes=static)


def without_host_reads(monkeypatch) -> None:
    """The recall step's route for a GPU (nothing read back), here on the CPU, where the eager step
    may read its CPU-resident state (``recall.step.host_reads_allowed``)."""
    from h2ochat.recall import step, tier

    for module in (step, tier):
        monkeypatch.setattr(module, "host_reads_allowed", lambda state: False)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_eager_recall_decode_step_reads_nothing_back(models, family, seed, monkeypatch):
    without_host_reads(monkeypatch)
    model = models[family]
    cache = _cache(model, static=False)
    forward(model, cache, torch.randint(3, VOCAB, (2, 30)))
    forward(model, cache, torch.randint(3, VOCAB, (2, 1)))
    log: list[str] = []
    with python_reads(log), HostReads() as mode:
        forward(model, cache, torch.randint(3, VOCAB, (2, 1)), logits_to_keep=1)
    assert log == [] and mode.reads == [], (log, mode.reads)
    assert all(int(layer.tier.frames.copied.sum()) > 0 for layer in cache.layers)


@pytest.mark.parametrize("family,selector,cold_dtype,every", [("opt", "int4", "same", 1), ("llama", "exact", "int8", 3),
                                                              ("neox", "int4", "int8-values", 2)])
def test_the_cpu_route_that_reads_its_state_is_the_route_that_does_not(models, family, seed, selector, cold_dtype,
                                                                      every, monkeypatch):
    """A 30-token prompt, then 40 decode steps (evicting, flushing, recalling, growing, re-numbering):
    the eager CPU step that reads its plan and skips choosing while nothing is cold gives the logits
    and every state tensor of the step that reads nothing back, bit for bit."""
    model = models[family]
    prompt, tokens = torch.randint(3, VOCAB, (2, 30)), torch.randint(3, VOCAB, (40, 2, 1))
    runs = []
    for reads in (True, False):
        with monkeypatch.context() as patch:
            if not reads:
                without_host_reads(patch)
            cache = _cache(model, selector=selector, cold_dtype=cold_dtype, every=every, static=False)
            logits = [forward(model, cache, prompt, logits_to_keep=1)]
            logits += [forward(model, cache, step, logits_to_keep=1) for step in tokens]
            runs.append((torch.stack(logits), cache))
    (reading, cache), (not_reading, reference) = runs
    assert torch.equal(reading, not_reading)
    for layer, other in zip(cache.layers, reference.layers):
        state, want = layer.state_tensors(), other.state_tensors()
        assert state.keys() == want.keys() and all(torch.equal(state[name], want[name]) for name in want), layer.layer_idx
    assert int(cache.layers[0].tier.frames.copied.sum()) > 0 and cache.compactions >= 1


@pytest.mark.parametrize("family,selector,cold_dtype,every,rule", [
    ("opt", "int4", "same", 1, "in-step"), ("llama", "exact", "int8", 3, "in-step"),
    ("neox", "int4", "int8-values", 2, "in-step"), ("llama", "exact", "same", 1, "before")])
def test_compiled_recall_decode_is_eager_bit_for_bit(models, family, seed, selector, cold_dtype, every, rule):
    """Two rows, a 30-token prompt, then 40 decode steps (evicting, staging, flushing, recalling every
    ``every`` steps, growing the cold store and re-numbering at the 64-position limit): the compiled
    step's logits and every state tensor equal the eager step's exactly, in one graph. By the in-step
    rule the graph chooses with the step's own queries (``graph_choice``): a cache by the other rule
    (pages chosen before the step) holds other pages on some step, so the two are told apart."""
    model = models[family]
    other = "before" if rule == "in-step" else "in-step"
    caches = [_cache(model, selector=selector, cold_dtype=cold_dtype, every=every, rule=r) for r in (rule, rule, other)]
    prompt = torch.randint(3, VOCAB, (2, 30))
    for cache in caches:
        forward(model, cache, prompt)
    step = compiled.CompiledDecode(model, backend="aot_eager")
    assert step.prepare(caches[1])
    graphs = counters["stats"]["unique_graphs"]
    recalled_during_decode, steps_the_rules_differ = 0, 0
    for index in range(40):
        tokens = torch.randint(3, VOCAB, (2,))
        before = int(caches[0].layers[0].tier.frames.copied.sum())
        want = forward(model, caches[0], tokens.view(-1, 1), logits_to_keep=1)[:, -1]
        got = step(caches[1], tokens)
        forward(model, caches[2], tokens.view(-1, 1), logits_to_keep=1)
        recalled_during_decode += int(caches[0].layers[0].tier.frames.copied.sum()) - before
        assert torch.equal(got, want), f"step {index}: {(got - want).abs().max()}"
        steps_the_rules_differ += any(not torch.equal(a.tier.frames.frame_page, b.tier.frames.frame_page)
                                      for a, b in zip(caches[1].layers, caches[2].layers))
    assert steps_the_rules_differ > 0
    for eager_layer, compiled_layer in zip(caches[0].layers, caches[1].layers):
        eager_state, compiled_state = eager_layer.state_tensors(), compiled_layer.state_tensors()
        assert eager_state.keys() == compiled_state.keys()
        for name, tensor in eager_state.items():
            assert torch.equal(compiled_state[name], tensor), name
        assert compiled_layer.slots_in_use == eager_layer.slots_in_use
    assert caches[1].compactions == caches[0].compactions >= 1
    # the cold store grew (and the digest), pages were flushed and chosen, positions re-numbered: all of
    # it before the step, eagerly, so the step is one graph whatever the length
    assert caches[1].layers[0].tier.cold.capacity > 32 and counters["stats"]["unique_graphs"] - graphs == 1
    assert recalled_during_decode > 0


def test_what_the_compiled_step_does_not_take(models):
    model = models["llama"]
    assert _cache(model).compile_blocker() is None
    assert _cache(model, every=2).compile_blocker() is None  # (the cadence is decided before the step)
    from h2ochat.recall.spec import RecallSpec

    # a row left out of a step stages nothing (issue 34: a server's free rows sit recall steps out), and a
    # prefix cache over the first rows steps the same tiers (tests/test_recall_prefix.py)
    assert RecallSpec.masks_inactive_rows is True and _cache(model).masks_inactive_rows
    assert _cache(model).row_prefixes


def test_inductor_hands_the_choice_the_layer_s_own_slots(seed):
    """Inductor (what a server's --compile runs) calls the choice op (``graph_choice``) on the layer's
    own per-slot buffers, not copies of them (the pages land where the attention reads them, with no
    copy of the slots in and out each step), once a layer, and the step copies no slot tensor whole; its
    steps choose the pages the eager step chooses and give its logits (a one-layer Llama: inductor's C++
    takes minutes a layer on this CPU)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = build_model("llama", seed=0, num_hidden_layers=1)
    caches, prompt = [_cache(model, selector="exact") for _ in range(2)], torch.randint(3, VOCAB, (2, 30))
    for cache in caches:
        forward(model, cache, prompt)
    step = compiled.CompiledDecode(model, backend="inductor")
    for index in range(12):
        tokens = torch.randint(3, VOCAB, (2,))
        want = forward(model, caches[0], tokens.view(-1, 1), logits_to_keep=1)[:, -1]
        if index == 0:
            got, codes = run_and_get_code(step, caches[1], tokens)
            calls = [line for code in codes for line in code.splitlines() if "h2ochat.recall_choose.default(" in line]
            assert len(calls) == 1, calls
            # keys, values, token index, positions: graph inputs (argN_1) or views of them, not copies (bufN)
            written = re.findall(r"\b(arg\d+_1|buf\d+)\b", calls[0].split("[", 1)[1].split("]", 1)[0])
            assert len(written) == 4 and all(arg.startswith("arg") for arg in written), calls
            # and writes its slots in place: no loop over a whole keys or values tensor (the staging page, written
            # through a view of the slots, was rebuilt so: a copy of all of them each step, session 66)
            layer = caches[1].layers[0]
            whole = [f"<static_cast<int64_t>({tensor.numel()}L)" for tensor in (layer.keys, layer.values)]
            assert not [bound for bound in whole if any(bound in code for code in codes)], whole
        else:
            got = step(caches[1], tokens)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(caches[1].layers[0].tier.frames.frame_page, caches[0].layers[0].tier.frames.frame_page)
    assert int(caches[1].layers[0].tier.frames.copied.sum()) > 0
    torch._dynamo.reset()


def test_a_step_built_from_inductor_s_disk_cache_runs_whatever_mode_made_its_cache(seed, tmp_path, monkeypatch):
    """Inductor keeps compiled steps on disk (AOTAutograd's cache, then its own) for the next process of
    the same shapes. The recall step writes tensors that alias others (the tier's columns are views of
    the layer's slots), which AOTAutograd merges into one base per storage; the base's kind follows how
    the views were made (a view made outside inference mode has an autograd ``_base``, one made inside
    has none), and the disk cache's key does not say which. A server allocates its cache outside
    inference mode, a bench or a chat inside: a step the one compiled, read back by the other, failed
    on its first call (``wrong number of dimensions``). The port's views carry no base in either mode, and
    the step makes the columns it writes inside its graph (no such inputs at all)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", True)
    monkeypatch.setattr(inductor_config, "force_disable_caches", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", True)
    model = build_model("llama", seed=0, num_hidden_layers=1)
    config = model.config
    prompt = torch.randint(3, VOCAB, (2, 30))
    tokens = [torch.randint(3, VOCAB, (2,)) for _ in range(3)]
    counters.clear()
    for inference in (False, True):  # a server's way, then a chat's, in "another process" (dynamo reset)
        torch._dynamo.reset()
        with torch.inference_mode(inference):
            cache, reference = _cache(model, selector="exact"), _cache(model, selector="exact")
            for each in (cache, reference):
                each.allocate(2, config.num_key_value_heads, config.head_dim, dtype=torch.float32, device=torch.device("cpu"))
                forward(model, each, prompt)
            step = compiled.CompiledDecode(model, backend="inductor")
            for token in tokens:
                want = forward(model, reference, token.view(-1, 1), logits_to_keep=1)[:, -1]
                torch.testing.assert_close(step(cache, token), want, rtol=1e-4, atol=1e-4)
    assert counters["aot_autograd"]["autograd_cache_hit"] >= 1, dict(counters["aot_autograd"])  # (read back, not built again)
    torch._dynamo.reset()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_step_runs_a_recall_server_s_buckets(models, family, seed):
    """A server's buckets (``H2OCache.prefix``: its first 1, 2 and 4 rows, sharing its tiers) through the
    compiled step of a symbolic batch (``CompiledDecode(graphs=3)``: a graph for one row, one for more), the
    free rows of each bucket left out: the logits and every state tensor equal the eager steps' of the
    same buckets of another cache, bit for bit, in two graphs."""
    model = models[family]
    caches = [_cache(model) for _ in range(2)]
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (4, 30), generator=generator)
    for cache in caches:
        forward(model, cache, prompt)
    eager_views = {size: caches[0].prefix(size) for size in (1, 2, 4)}
    compiled_views = {size: caches[1].prefix(size) for size in (1, 2, 4)}
    step = compiled.CompiledDecode(model, backend="aot_eager", graphs=3)
    graphs = counters["stats"]["unique_graphs"]
    for index in range(36):
        size = (1, 2, 4, 2)[index // 3 % 4]
        tokens = torch.randint(3, VOCAB, (size,), generator=generator)
        active = torch.ones(size, dtype=torch.bool)
        active[-1] = size == 1 or index % 2 == 0  # (a free row inside the bucket, every other step)
        want = forward(model, eager_views[size], tokens.view(-1, 1), logits_to_keep=1, active=active)[:, -1]
        got = step(compiled_views[size], tokens, active)
        assert torch.equal(got[active], want[active]), f"step {index} ({size} rows)"
    assert counters["stats"]["unique_graphs"] - graphs == 2
    for eager_layer, compiled_layer in zip(caches[0].layers, caches[1].layers):
        eager_state, compiled_state = eager_layer.state_tensors(), compiled_layer.state_tensors()
        for name, tensor in eager_state.items():
            assert torch.equal(compiled_state[name], tensor), name
    assert int(caches[1].layers[0].tier.frames.copied.sum()) > 0 and caches[1].compactions >= 1
