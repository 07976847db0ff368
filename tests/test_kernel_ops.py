"""The Triton launchers as ``torch.library`` custom ops (``h2ochat_kernels.ops``), checked on the CPU
so that a graph break or an undeclared write can never first show up on a GPU.

- Each op against ``torch.library.opcheck`` (its schema declares every input it writes, its fake
  implementation gives the real outputs' shapes, dtypes and strides, it traces under AOT autograd
  with dynamic shapes) and against the torch reference, on tiny fresh random inputs.
- The decode step of a tiny model of each family compiled (fullgraph) with the Triton path forced,
  the kernels running under the Triton interpreter: dynamo captures one graph in which each layer's
  attention and eviction is one ``h2ochat`` op node and nothing of the launch code, AOT autograd
  turns the ops' declared writes into functional nodes written back to the cache, and the compiled
  steps give eager's tokens, kept slots and scores over steps that evict.

Dynamo does not guard on ``H2OCHAT_KERNELS``: every compiled test starts and ends with
``torch._dynamo.reset()`` so neither the torch-path graphs of other modules nor these are reused.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from functorch.compile import make_boxed_func  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

from conftest import build_model, random_ids  # noqa: E402
from h2ochat_kernels import ops, reference  # noqa: E402
from test_kernels import (DEVICE, check_attention, make_evict_inputs, make_inputs, make_policy_state,  # noqa: E402
                          on_device, per_seq, runs_kernels)

OPS = {name: getattr(torch.ops.h2ochat, name).default for name in ops.OPS}


def as_kernel(op):
    """An attention op called like the launchers ``check_attention`` takes (``out=``, ``decay=``)."""
    def kernel(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scale, scores, *,
               out, decay):
        number, rows = ops._split(decay)
        got, new_scores = op(query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid,
                             float(scale), scores, float(number), rows)
        return out.copy_(got), new_scores
    return kernel


def opcheck(op, args):
    """torch.library.opcheck on clones (it runs the op several times, each writing its inputs)."""
    clones = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    results = torch.library.opcheck(op, clones)
    assert set(results.values()) == {"SUCCESS"}, results


# -- each op on its own --------------------------------------------------------------------------------

@runs_kernels
@pytest.mark.parametrize("name,q_len,decay,dtype", [
    pytest.param("decode_attend", 1, 0.5, torch.float32, id="decode-fp32-decay0.5"),
    pytest.param("decode_attend", 1, "rows", torch.float16, id="decode-fp16-decayperrow"),
    pytest.param("chunk_attend", 5, 1.0, torch.float32, id="chunk-fp32"),
    pytest.param("chunk_attend", 4, "rows", torch.bfloat16, id="chunk-bf16-decayperrow"),
])
def test_attention_ops_pass_opcheck_and_match_the_reference(seed, name, q_len, decay, dtype):
    inputs, _ = make_inputs(2, 2, 2, q_len, 19, 32, dtype, padding=True, strided=True)
    if decay == "rows":  # per sequence, an exact 0 included
        decay = on_device(torch.tensor([0.0, 0.7]))
    number, rows = ops._split(decay)
    opcheck(OPS[name], (*inputs.values(), float(number), rows))
    check_attention(as_kernel(OPS[name]), inputs, seed, decay=decay)


def compare_eviction(seed, run_op, run_reference, state):
    """The op and the reference on copies of ``state``: the same dropped tokens and scores, the same
    slots written."""
    mine, ref = [t.clone() for t in state], [t.clone() for t in state]
    got, want = run_op(mine), run_reference(ref)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), f"seed={seed}"
    assert all(torch.equal(a, b) for a, b in zip(mine, ref)), f"seed={seed}"
    assert not all(torch.equal(a, b) for a, b in zip(mine, state)), f"seed={seed}: nothing was written"


@runs_kernels
@pytest.mark.parametrize("value_norm,active", [pytest.param(False, None, id="fp16"),
                                               pytest.param(True, None, id="fp16-valuenorm"),
                                               pytest.param(True, [False, True], id="fp16-valuenorm-rowleftout")])
def test_evict_and_insert_op(seed, value_norm, active):
    state, new = make_evict_inputs(2, 2, 21, 32, torch.float16, ties=True, value_norm=value_norm)
    norms = (state[6], new[5]) if value_norm else (None, None)
    active = on_device(torch.tensor(active)) if active is not None else None
    opcheck(OPS["evict_and_insert"], (*state[:6], *new[:5], *norms, active))

    def call(fn, s):
        return fn(*s[:6], *new[:5], *(s[6], new[5]) if value_norm else (None, None), active)

    compare_eviction(seed, lambda s: call(OPS["evict_and_insert"], s), lambda s: call(reference.evict_and_insert, s),
                     state)


@runs_kernels
@pytest.mark.parametrize("policy", [
    pytest.param(dict(recent=4, sinks=0), id="bf16-h2o"),
    pytest.param(dict(recent=3, sinks=4, oldest_first=True), id="bf16-sink"),
    pytest.param(dict(recent=per_seq(2, 5), sinks=per_seq(4, 1), by_age=True, value_eps=0.25),
                 id="bf16-mean-valueeps-perrow"),
    pytest.param(dict(recent=4, sinks=1, active=[True, False]), id="bf16-h2o-rowleftout"),
])
def test_evict_by_policy_op(seed, policy):
    state, new = make_policy_state(2, 2, 24, 32, torch.bfloat16, ties=True, recent=policy["recent"],
                                   sinks=policy["sinks"])
    active = policy.pop("active", None)
    active = on_device(torch.tensor(active)) if active is not None else None
    policy = {k: on_device(v) for k, v in policy.items()}
    flags = (policy.get("oldest_first", False), policy.get("by_age", False), policy.get("value_eps"))
    windows = (*ops._split(policy["recent"]), *ops._split(policy["sinks"]))
    new_token = new[:5]
    norms = (state[5], new[5])  # kept and new value norms, used when the rank asks for them

    def op(s):
        return OPS["evict_by_policy"](*s[:5], *new_token, s[5], norms[1], *windows, *flags, active)

    opcheck(OPS["evict_by_policy"], (*state[:5], *new_token, *norms, *windows, *flags, active))
    compare_eviction(seed, op, lambda s: reference.evict_by_policy(*s[:5], *new_token, s[5], norms[1], active,
                                                                   **policy), state)


def test_fake_implementations_give_the_launchers_shapes_without_running_them():
    """Under FakeTensorMode (what dynamo traces with) each op returns its outputs' metadata and never
    launches: the shapes a compiled graph plans with, here for a GPU-sized GQA step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        b, h, g, s, d = 3, 8, 4, 819, 128
        q = torch.empty(b, h, g, 1, d, dtype=torch.bfloat16)
        kv = torch.empty(b, h, s, d, dtype=torch.bfloat16)
        index = torch.empty(b, h, s, dtype=torch.int64)
        scores = torch.empty(b, h, s)
        new_kv = torch.empty(b, h, 1, d, dtype=torch.bfloat16)
        out, new_scores = OPS["decode_attend"](q, kv, kv, index, new_kv, new_kv, None, 0.1, scores, 1.0, None)
        assert (out.shape, out.dtype, new_scores.shape, new_scores.dtype) == (q.shape, q.dtype, (b, h, 1), torch.float32)
        chunk = torch.empty(b, h, g, 7, d, dtype=torch.bfloat16)
        new7 = torch.empty(b, h, 7, d, dtype=torch.bfloat16)
        out, new_scores = OPS["chunk_attend"](chunk, kv, kv, index, new7, new7, None, 0.1, scores, 0.9, None)
        assert (out.shape, new_scores.shape) == (chunk.shape, (b, h, 7))
        new = (new_kv, new_kv, torch.empty(b, h), torch.empty(b, dtype=torch.int64), torch.empty(b, dtype=torch.int64))
        dropped, dropped_score = OPS["evict_by_policy"](kv, kv, scores, index, index, *new, None, None, 4, None, 0, None,
                                                        False, False, None)
        assert (dropped.shape, dropped.dtype, dropped_score.dtype) == ((b, h), torch.int64, torch.float32)


# -- the compiled decode step ------------------------------------------------------------------------------

class Recorder:
    """A torch.compile backend keeping what dynamo captured (graph and inputs) and the AOT
    (functionalised) graph, then running the latter (aot_eager's path: no code generation). Input
    writes stay in the AOT graph as ``copy_`` into the input, as inductor keeps them."""

    def __init__(self):
        self.dynamo: list[torch.fx.GraphModule] = []
        self.inputs: list[list[torch.Tensor]] = []
        self.aot: list[torch.fx.GraphModule] = []

        def keep(gm, example_inputs):
            self.aot.append(gm)
            return make_boxed_func(gm.forward)

        self.compile_aot = aot_autograd(fw_compiler=keep, keep_inference_input_mutations=True)

    def __call__(self, gm, example_inputs):
        self.dynamo.append(gm)
        self.inputs.append(list(example_inputs))
        return self.compile_aot(gm, example_inputs)

    def written_inputs(self) -> list[torch.Tensor]:
        """The inputs the (single) compiled graph writes."""
        placeholders = [n for n in self.aot[0].graph.nodes if n.op == "placeholder"]
        assert len(placeholders) == len(self.inputs[0])
        written = {placeholders.index(n.args[0]) for n in self.aot[0].graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
                   and n.args[0].op == "placeholder"}
        return [self.inputs[0][i] for i in sorted(written)]


def assert_writes_only_state_tensors(recorder: Recorder, cache, msg):
    """A CUDA graph replays fixed addresses, and cudagraph trees refuse a graph writing an input not
    marked static: every tensor the step writes must be one ``CompiledDecode.prepare`` marks, i.e.
    one of the layers' ``state_tensors()``; the slots of every layer are among them."""
    state = {t.data_ptr(): name for layer in cache.layers for name, t in layer.state_tensors().items()}
    written = [state.get(t.data_ptr(), f"not a state tensor {tuple(t.shape)}") for t in recorder.written_inputs()]
    assert all(not w.startswith("not a state") for w in written), (msg, written)
    assert written.count("keys") == written.count("values") == written.count("token_index") == len(cache.layers), msg


def op_counts(graph: torch.fx.GraphModule) -> dict[str, int]:
    """How many call nodes of each h2ochat op the graph holds (directly or inside a functionalising
    wrapper such as auto_functionalized)."""
    counts: dict[str, int] = {}
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        for target in (node.target, *node.args[:1], node.kwargs.get("_mutable_op")):
            name = str(target)  # h2ochat.decode_attend (dynamo) or h2ochat.decode_attend.default (AOT)
            if name.startswith("h2ochat."):
                key = name.split(".")[1]
                counts[key] = counts.get(key, 0) + 1
                break
    return counts


def writes_through_functional_wrappers(graph: torch.fx.GraphModule) -> bool:
    """Every h2ochat op in the AOT graph sits inside a functionalising wrapper (its writes were
    declared, so AOT autograd knows them), none is called as a bare mutating op."""
    for node in graph.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("h2ochat."):
            return False
    return True


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def decode_run(model, ids, policy, steps, monkeypatch, decoder=None, kernels="triton", kv_dtype="auto"):
    """Prefill, then ``steps`` greedy decode steps, all on the ``kernels`` path (a layer chooses its
    eviction when it allocates); compiled decode steps when ``decoder`` is given."""
    from h2ochat.engine.generation import CacheSettings, forward

    monkeypatch.setenv("H2OCHAT_KERNELS", kernels)
    cache = CacheSettings(policy=policy, budget="8", kv_dtype=kv_dtype).build(model, static_shapes=True)
    logits = forward(model, cache, ids, logits_to_keep=1)[:, -1]
    tokens = []
    for _ in range(steps):
        token = logits.argmax(-1)
        tokens.append(token)
        logits = decoder(cache, token) if decoder else forward(model, cache, token[:, None])[:, -1]
    return torch.stack(tokens), cache, logits


@pytest.mark.skipif(DEVICE.type != "cpu", reason="compiles on the CPU, the kernels under the Triton interpreter")
@runs_kernels
@pytest.mark.parametrize("family,policy", [
    ("llama", "h2o"),  # the default policy, GQA
    ("neox", "h2o"),
    ("opt", "mean:decay=0.5:value_eps=0.1"),  # decayed scores in the decode kernel, value norms in the eviction
])
def test_compiled_triton_decode_is_one_graph_of_opaque_ops(seed, monkeypatch, fresh_dynamo, family, policy):
    from h2ochat.engine import compiled

    model = build_model(family)
    layers = model.config.num_hidden_layers
    ids = random_ids(2, 6)  # 6 of 8 slots: two steps grow the cache, three evict
    recorder = Recorder()
    decoder = compiled.CompiledDecode(model, backend=recorder)
    eager_tokens, eager_cache, eager_logits = decode_run(model, ids, policy, 5, monkeypatch)
    tokens, cache, logits = decode_run(model, ids, policy, 5, monkeypatch, decoder)

    msg = f"seed={seed} {family} {policy}"
    assert len(recorder.dynamo) == len(recorder.aot) == 1, msg  # fullgraph, and no recompile as the cache fills
    assert op_counts(recorder.dynamo[0]) == {"decode_attend": layers, "evict_by_policy": layers}, msg
    code = recorder.dynamo[0].code
    assert "triton" not in code and "launch" not in code, msg  # nothing of the launch code was traced
    assert op_counts(recorder.aot[0]) == {"decode_attend": layers, "evict_by_policy": layers}, msg
    assert writes_through_functional_wrappers(recorder.aot[0]), msg
    assert_writes_only_state_tensors(recorder, cache, msg)

    # aot_eager runs the very ops eager runs (the kernels included): the runs are bitwise equal (checked:
    # logits and scores differ by 0.0), so comparing tokens exactly leaves no near-tie to decide
    assert torch.equal(tokens, eager_tokens), msg
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5, msg=msg)
    assert eager_cache.evicted_tokens() > 0, msg
    for mine, ref in zip(cache.layers, eager_cache.layers):
        assert torch.equal(mine.token_index, ref.token_index), msg  # the same slots, in the same places
        assert torch.equal(mine.positions, ref.positions), msg
        torch.testing.assert_close(mine.scores, ref.scores, rtol=1e-5, atol=1e-6, msg=msg)
        torch.testing.assert_close(mine.keys, ref.keys, rtol=0, atol=0, msg=msg)
        if ref.value_norm is not None:
            torch.testing.assert_close(mine.value_norm, ref.value_norm, rtol=1e-6, atol=1e-6, msg=msg)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="compiles on the CPU, the kernels under the Triton interpreter")
@runs_kernels
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_compiled_triton_decode_over_quantised_slots(seed, monkeypatch, fresh_dynamo, kv_dtype):
    """With the slots quantised, each layer's attention is still one opaque decode op (the codes,
    scales and offsets its inputs; the layer writes the codes itself), one graph with no recompile,
    and the compiled steps give eager's tokens and slots."""
    from h2ochat.engine import compiled

    model = build_model("llama")
    layers = model.config.num_hidden_layers
    ids = random_ids(2, 6)
    recorder = Recorder()
    decoder = compiled.CompiledDecode(model, backend=recorder)
    eager_tokens, eager_cache, eager_logits = decode_run(model, ids, "h2o", 5, monkeypatch, kv_dtype=kv_dtype)
    tokens, cache, logits = decode_run(model, ids, "h2o", 5, monkeypatch, decoder, kv_dtype=kv_dtype)

    msg = f"seed={seed} {kv_dtype}"
    assert len(recorder.dynamo) == len(recorder.aot) == 1, msg
    assert op_counts(recorder.dynamo[0]) == {"decode_attend": layers}, msg
    code = recorder.dynamo[0].code
    assert "triton" not in code and "launch" not in code, msg
    assert_writes_only_state_tensors(recorder, cache, msg)
    assert torch.equal(tokens, eager_tokens), msg
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5, msg=msg)
    assert eager_cache.evicted_tokens() > 0, msg
    for mine, ref in zip(cache.layers, eager_cache.layers):
        assert mine.keys.dtype == torch.uint8 and torch.equal(mine.keys, ref.keys), msg
        assert torch.equal(mine.token_index, ref.token_index), msg
        torch.testing.assert_close(mine.stored["key_scale"], ref.stored["key_scale"], rtol=1e-6, atol=1e-7, msg=msg)


def test_compiled_torch_decode_writes_only_state_tensors(seed, monkeypatch, fresh_dynamo):
    """The same check on the torch path (H2OCHAT_KERNELS=torch, what a GPU without triton runs): its
    in-place writes (index_put_, +=) touch nothing but the layers' state tensors."""
    from h2ochat.engine import compiled

    model = build_model("llama")
    recorder = Recorder()
    decoder = compiled.CompiledDecode(model, backend=recorder)
    _, cache, _ = decode_run(model, random_ids(2, 6), "mean:value_eps=0.1", 3, monkeypatch, decoder, kernels="torch")
    assert len(recorder.aot) == 1
    assert_writes_only_state_tensors(recorder, cache, f"seed={seed}")


def call_arguments(code: str, op: str) -> list[list[str]]:
    """The arguments (as source text) of every call of ``op`` in inductor's generated wrapper."""
    calls = []
    for line in code.splitlines():
        start = line.find(f"{op}.default(")
        if start < 0:
            continue
        text, depth, args, current = line[start + len(op) + len(".default("):], 0, [], ""
        for char in text:
            if char == "," and depth == 0:
                args.append(current.strip())
                current = ""
                continue
            if char == ")" and depth == 0:
                break
            depth += (char in "([") - (char in ")]")
            current += char
        calls.append(args + [current.strip()])
    return calls


@pytest.mark.skipif(DEVICE.type != "cpu", reason="compiles on the CPU, the kernels under the Triton interpreter")
@runs_kernels
def test_inductor_writes_the_cache_in_place(seed, monkeypatch, fresh_dynamo):
    """Inductor (what --compile runs) hands the cache's own buffers to the eviction and attention ops:
    the declared writes land in place, no copy of the K/V slots in and out every step (which would
    cost a whole cache's bandwidth per token on a GPU). One layer of Llama (GQA), steps that evict;
    the first compiled step's logits are eager's (inductor's fused arithmetic differs in rounding
    only: later tokens are not compared, a near-tie could pick another)."""
    from torch._inductor.utils import run_and_get_code

    from h2ochat.engine import compiled

    model = build_model("llama", num_hidden_layers=1)
    ids = random_ids(2, 6)
    decoder = compiled.CompiledDecode(model, backend="inductor")
    _, _, eager_first = decode_run(model, ids, "h2o", 1, monkeypatch)
    codes, first = [], []

    def first_step_with_code(cache, token):
        if codes:
            return decoder(cache, token)
        logits, generated = run_and_get_code(decoder, cache, token)
        codes.extend(generated)
        first.append(logits)
        return logits

    _, cache, logits = decode_run(model, ids, "h2o", 4, monkeypatch, first_step_with_code)
    msg = f"seed={seed}"
    assert len(codes) == 1, msg
    evictions = call_arguments(codes[0], "torch.ops.h2ochat.evict_by_policy")
    attentions = call_arguments(codes[0], "torch.ops.h2ochat.decode_attend")
    assert len(evictions) == len(attentions) == 1, (msg, codes[0])
    # keys, values, scores, token index, positions: graph inputs themselves (argN_1), not copies (bufN)
    written = evictions[0][:5]
    assert all(arg.startswith("arg") and arg.endswith("_1") for arg in written), (msg, written)
    assert attentions[0][1:3] == written[:2] and attentions[0][8] == written[2], (msg, attentions[0], written)
    torch.testing.assert_close(first[0], eager_first, rtol=1e-4, atol=1e-4, msg=msg)
    assert cache.evicted_tokens() > 0 and torch.isfinite(logits).all(), msg
