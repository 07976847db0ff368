"""The attention kernel of decode steps and prompt chunks (``h2ochat_kernels.cpu.attention_ops``) against the torch reference
(``reference.attend_with_scores`` with ``H2OCHAT_CPU_KERNELS=none``), on every variant this CPU runs
(``cpu_routes.attention_route``: avx512bf16, avx2, generic), each skipped with its reason where the CPU or the
install lacks it.

Tolerances: the kernel sums in fp32 in another order than torch. fp32: outputs and scores within 1e-5 relative
(atol 1e-6) of torch's. bf16: the yardstick is the reference run in fp32 on the same bf16 values (torch's own bf16
route rounds the logits and probabilities to bf16, so it is further from the exact result than the kernel is);
the output within its bf16 rounding (rtol 2^-7, atol 2^-8 on values of ~1), the scores (fp32 sums) within 1e-5;
and against torch's bf16 route itself within a few bf16 roundings of its logits."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, random_ids
from cpu_routes import attention_route, torch_route  # noqa: F401 (fixtures)

from h2ochat.engine.generation import CacheSettings, forward, prefill
from h2ochat_kernels import dispatch, reference
from h2ochat_kernels.cpu import attention_ops

OP = "h2ochat.cpu_attend_with_scores"  # the custom op, as a traced graph's node names it
pytestmark = pytest.mark.usefixtures("attention_route")  # every test here on every variant this CPU runs


def test_the_route_is_the_variant_asked_for(attention_route):
    assert attention_ops.available(), attention_ops.why_not()
    assert attention_ops.variant_name() == attention_route


def test_the_switch_turns_it_off(torch_route):
    torch_route()
    assert not attention_ops.available() and "H2OCHAT_CPU_KERNELS=none" in attention_ops.why_not()


def _step(batch, heads, group, slots, dim, dtype, generator, strided=False, empty=0.3):
    """A decode step's arguments: queries [B, H, G, 1, D], slots (a view of the first ``slots`` of more columns and
    of the first D of more channels where ``strided``), some slots empty (token index -1), fp32 scores."""
    query = torch.randn(batch, heads, group, 1, dim, generator=generator).to(dtype)
    if strided:
        store = torch.randn(2, batch, heads, slots + 9, dim + 5, generator=generator).to(dtype)
        keys, values = store[0, :, :, :slots, :dim], store[1, :, :, :slots, :dim]
    else:
        keys, values = (torch.randn(batch, heads, slots, dim, generator=generator).to(dtype) for _ in range(2))
    index = torch.arange(slots).expand(batch, heads, slots).clone()
    index[torch.rand(batch, heads, slots, generator=generator) < empty] = -1
    new_keys, new_values = (torch.randn(batch, heads, 1, dim, generator=generator).to(dtype) for _ in range(2))
    scores = torch.rand(batch, heads, slots, generator=generator) * 3
    return query, keys, values, index, new_keys, new_values, scores


def _both(args, new_valid, scale, decay, reference_dtype=None, rest=None):
    """(the kernel's (out, new_scores, scores), the reference's) for the same step (with a recall tier's ``rest``
    column where given); the reference on the inputs converted to ``reference_dtype`` where given."""
    query, keys, values, index, new_keys, new_values, scores = args
    kernel_scores, reference_scores = scores.clone(), scores.clone()
    got = attention_ops.attend_with_scores(query, keys, values, index, new_keys, new_values, new_valid, scale,
                                           kernel_scores, decay, rest=rest)
    assert got is not None, attention_ops.why_not()
    floats = [query, keys, values, new_keys, new_values]
    if reference_dtype is not None:
        floats = [t.to(reference_dtype) for t in floats]
    want = reference.attend_with_scores(floats[0], floats[1], floats[2], index, floats[3], floats[4], new_valid,
                                        scale, reference_scores, decay, rest=rest)
    return (*got, kernel_scores), (*want, reference_scores)


SHAPES = [(1, 64, 70), (3, 67, 129), (8, 128, 33), (3, 64, 300)]  # (G, D, S): tails in D and in the blocks of S


@pytest.mark.parametrize("group,dim,slots", SHAPES)
@pytest.mark.parametrize("decay", [1.0, 0.5])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_fp32_is_the_torch_route(group, dim, slots, decay, padding, strided):
    generator = torch.Generator().manual_seed(group * 1000 + dim + slots)
    args = _step(2, 3, group, slots, dim, torch.float32, generator, strided)
    new_valid = torch.tensor([[True], [False]]) if padding else None
    got, want = _both(args, new_valid, dim ** -0.5, decay)
    assert got[0].dtype == torch.float32 and got[0].shape == want[0].shape and got[1].shape == want[1].shape
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("group,dim,slots", SHAPES)
@pytest.mark.parametrize("decay", [1.0, 0.5])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_bf16_is_the_exact_result_to_its_rounding(group, dim, slots, decay, padding, strided):
    generator = torch.Generator().manual_seed(group * 1000 + dim + slots + 1)
    args = _step(2, 3, group, slots, dim, torch.bfloat16, generator, strided)
    new_valid = torch.tensor([[False], [True]]) if padding else None
    got, exact = _both(args, new_valid, dim ** -0.5, decay, reference_dtype=torch.float32)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0].float(), exact[0], rtol=2 ** -7, atol=2 ** -8)
    torch.testing.assert_close(got[1], exact[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], exact[2], rtol=1e-5, atol=1e-6)
    _, torch_bf16 = _both(args, new_valid, dim ** -0.5, decay)  # torch's own bf16 route: logits rounded to bf16
    torch.testing.assert_close(got[0].float(), torch_bf16[0].float(), rtol=0.05, atol=0.03)
    torch.testing.assert_close(got[2], torch_bf16[2], rtol=0.05, atol=0.01)


def _chunk(batch, group, slots, dim, q_len, dtype, generator, padding):
    """A prompt chunk's arguments: ``_step``'s with Q new tokens (strided slots), and its padding mask where
    ``padding``: row 0 left-padded (a batch's shorter prompt), row 1 real throughout."""
    query, keys, values, index, _, _, scores = _step(batch, 3, group, slots, dim, dtype, generator, strided=True)
    query = torch.randn(batch, 3, group, q_len, dim, generator=generator).to(dtype)
    new_keys, new_values = (torch.randn(batch, 3, q_len, dim, generator=generator).to(dtype) for _ in range(2))
    new_valid = None
    if padding:
        new_valid = torch.ones(batch, q_len, dtype=torch.bool)
        new_valid[0, :q_len // 3] = False
    return (query, keys, values, index, new_keys, new_values, scores), new_valid


# (G, D, S, Q): new tokens past a block of keys; 70 and 200: a chunk of several blocks of the kernel's 64 tokens
CHUNKS = [(1, 64, 70, 2), (3, 67, 129, 19), (3, 64, 40, 70), (1, 32, 17, 200)]


@pytest.mark.parametrize("group,dim,slots,q_len", CHUNKS)
@pytest.mark.parametrize("decay", [1.0, 0.5, "per sequence"])
@pytest.mark.parametrize("padding", [False, True])
def test_a_prompt_chunk_in_fp32_is_the_torch_route(group, dim, slots, q_len, decay, padding):
    """Q new tokens attending the slots and, causally, each other; padding tokens read by no one and adding to no
    score; each row's probabilities weighed by decay ** (real rows after it) and the old scores decayed once per
    real row: the torch route's outputs, new scores and scores within fp32 rounding."""
    generator = torch.Generator().manual_seed(group * 1000 + dim + slots + q_len)
    args, new_valid = _chunk(2, group, slots, dim, q_len, torch.float32, generator, padding)
    if decay == "per sequence":
        decay = torch.tensor([0.5, 0.9])
    got, want = _both(args, new_valid, dim ** -0.5, decay)
    assert got[0].shape == want[0].shape == (2, 3, group, q_len, dim) and got[1].shape == want[1].shape
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("group,dim,slots,q_len", CHUNKS)
@pytest.mark.parametrize("padding", [False, True])
def test_a_prompt_chunk_in_bf16_is_the_exact_result_to_its_rounding(group, dim, slots, q_len, padding):
    generator = torch.Generator().manual_seed(group * 1000 + dim + slots + q_len + 1)
    args, new_valid = _chunk(2, group, slots, dim, q_len, torch.bfloat16, generator, padding)
    got, exact = _both(args, new_valid, dim ** -0.5, 0.5, reference_dtype=torch.float32)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0].float(), exact[0], rtol=2 ** -7, atol=2 ** -8)
    torch.testing.assert_close(got[1], exact[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], exact[2], rtol=1e-5, atol=1e-6)


def _hollow(index: torch.Tensor) -> torch.Tensor:
    """``index`` with whole blocks of the kernel's 16 slots empty (a recall tier's columns before pages come back, a
    cache's tail not filled yet): slots 20-63 and 100 on, beside the scattered empty slots it had."""
    index = index.clone()
    index[..., 20:64] = -1
    index[..., 100:] = -1
    return index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 19, 70])
def test_blocks_of_empty_slots_change_nothing(dtype, q_len):
    """Blocks of empty slots (which the kernel does not read): the torch route's result, and what the empty slots
    hold does not matter, to the bit."""
    generator = torch.Generator().manual_seed(q_len + 7)
    args, new_valid = _chunk(2, 3, 150, 64, q_len, dtype, generator, padding=True)
    args = (*args[:3], _hollow(args[3]), *args[4:])
    got, exact = _both(args, new_valid, 0.125, 0.5, reference_dtype=torch.float32)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -8)
    torch.testing.assert_close(got[0].float(), exact[0], **tolerance)
    torch.testing.assert_close(got[1], exact[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], exact[2], rtol=1e-5, atol=1e-6)
    query, keys, values, index, new_keys, new_values, scores = args
    empty = (index < 0).unsqueeze(-1)
    others = [torch.where(empty, torch.randn(t.shape, generator=generator).to(dtype), t) for t in (keys, values)]
    again, _ = _both((query, *others, index, new_keys, new_values, scores), new_valid, 0.125, 0.5)
    for a, b in zip(got, again):
        assert torch.equal(a, b)


def test_a_row_with_every_column_masked_reads_the_empty_blocks_too():
    """Every slot empty and a padding query row that may read no new token: the row softmaxes to a uniform row over
    every column, the empty slots' too (torch's rule), so the blocks of empty slots are read for it."""
    generator = torch.Generator().manual_seed(11)
    args, new_valid = _chunk(2, 3, 70, 64, 19, torch.float32, generator, padding=True)
    index = torch.full_like(args[3], -1)
    got, want = _both((*args[:3], index, *args[4:]), new_valid, 0.125, 1.0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_padding_row_adds_nothing_and_does_not_decay():
    generator = torch.Generator().manual_seed(3)
    args = _step(2, 2, 3, 40, 64, torch.float32, generator)
    scores = args[-1].clone()
    got, _ = _both(args, torch.tensor([[True], [False]]), 0.125, 0.5)
    out, new_scores, after = got
    assert torch.equal(after[1], scores[1]) and torch.equal(new_scores[1], torch.zeros_like(new_scores[1]))
    assert not torch.equal(after[0], scores[0])


def test_every_slot_empty_leaves_the_new_token_alone():
    """A row whose slots are all empty attends to its new token only: its value, probability 1 per query."""
    generator = torch.Generator().manual_seed(4)
    args = _step(1, 2, 3, 20, 64, torch.float32, generator, empty=1.1)
    got, want = _both(args, None, 0.125, 1.0)
    new_values = args[5]
    torch.testing.assert_close(got[0], new_values.unsqueeze(2).expand_as(got[0]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], torch.full_like(got[1], 3.0))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _rest(batch, heads, group, q_len, dim, generator, none_at=(0, 1)):
    """A recall tier's rest column: a logit per query row (near the slots' own, so it takes a real share) and an
    fp32 value; the row and head ``none_at`` hold no unrecalled page (-inf)."""
    logit = torch.randn(batch, heads, group, q_len, generator=generator) + 1.0
    logit[none_at] = float("-inf")
    return logit, torch.randn(batch, heads, group, q_len, dim, generator=generator)


@pytest.mark.parametrize("q_len", [1, 19, 70])
@pytest.mark.parametrize("padding", [False, True])
def test_a_rest_column_joins_the_softmax_as_the_torch_route_has_it(q_len, padding):
    """With a recall tier's rest column (one more logit and value per query row, no slot): fp32 outputs, new scores
    and scores are the torch route's within fp32 rounding, the rest taking its share of every row's softmax and
    no score; bf16 the exact result to its rounding. A decode step, a chunk of one block and one of two."""
    generator = torch.Generator().manual_seed(40 + q_len)
    if q_len == 1:
        args = _step(2, 3, 3, 90, 64, torch.float32, generator, strided=True)
        new_valid = torch.tensor([[True], [False]]) if padding else None
    else:
        args, new_valid = _chunk(2, 3, 90, 64, q_len, torch.float32, generator, padding)
    rest = _rest(2, 3, 3, q_len, 64, generator)
    got, want = _both(args, new_valid, 0.125, 0.5, rest=rest)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    without, _ = _both(args, new_valid, 0.125, 0.5)
    assert not torch.allclose(got[0], without[0], atol=1e-3)  # (the rest moved the outputs)
    torch.testing.assert_close(got[0][0, 1], without[0][0, 1], rtol=1e-6, atol=1e-7)  # (none there: as without)
    bf16 = tuple(t.bfloat16() if t.is_floating_point() and i != 6 else t for i, t in enumerate(args))
    got, exact = _both(bf16, new_valid, 0.125, 0.5, reference_dtype=torch.float32, rest=rest)
    torch.testing.assert_close(got[0].float(), exact[0], rtol=2 ** -7, atol=2 ** -8)
    torch.testing.assert_close(got[2], exact[2], rtol=1e-5, atol=1e-6)


def test_every_slot_empty_beside_a_rest_column():
    """A row whose slots are all empty shares its softmax between its new token and the rest column alone."""
    generator = torch.Generator().manual_seed(41)
    args = _step(1, 2, 3, 20, 64, torch.float32, generator, empty=1.1)
    rest = _rest(1, 2, 3, 1, 64, generator, none_at=(0, 0))
    got, want = _both(args, None, 0.125, 1.0, rest=rest)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_chunk_of_several_blocks_is_the_same_on_any_threads():
    """A chunk's blocks are units of work spread over the threads; their received attention is summed in block
    order after, so one thread and two give the same bits."""
    generator = torch.Generator().manual_seed(42)
    args, new_valid = _chunk(1, 3, 150, 64, 200, torch.float32, generator, padding=True)
    rest = _rest(1, 3, 3, 200, 64, generator)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_both(args, new_valid, 0.125, 0.5, rest=rest)[0])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_per_sequence_decay_and_threads():
    generator = torch.Generator().manual_seed(5)
    args = _step(3, 2, 3, 50, 64, torch.float32, generator)
    decay = torch.tensor([1.0, 0.5, 0.0])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, want = _both(args, torch.tensor([[True], [True], [False]]), 0.125, decay)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_what_it_does_not_take_is_left_to_torch():
    """A chunk past 512 new tokens, mixed dtypes, D past 256, a non-unit stride along D: None, nothing written."""
    generator = torch.Generator().manual_seed(6)
    query, keys, values, index, new_keys, new_values, scores = _step(1, 2, 3, 20, 64, torch.float32, generator)
    before = scores.clone()
    many = attention_ops.MAX_NEW_TOKENS + 1
    assert attention_ops.attend_with_scores(query.expand(1, 2, 3, many, 64), keys, values, index,
                                            new_keys.expand(1, 2, many, 64), new_values.expand(1, 2, many, 64), None,
                                            0.1, scores) is None
    assert attention_ops.attend_with_scores(query, keys.bfloat16(), values, index, new_keys, new_values, None, 0.1,
                                       scores) is None
    wide = torch.randn(1, 2, 20, 128)[..., ::2]
    assert attention_ops.attend_with_scores(query, wide, values, index, new_keys, new_values, None, 0.1, scores) is None
    big = torch.randn(1, 2, 3, 1, 260)
    assert attention_ops.attend_with_scores(big, torch.randn(1, 2, 20, 260), torch.randn(1, 2, 20, 260), index,
                                       torch.randn(1, 2, 1, 260), torch.randn(1, 2, 1, 260), None, 0.1, scores) is None
    assert torch.equal(scores, before)


def _counting(monkeypatch) -> list:
    """Count the eager calls the torch backend makes to the kernel (one entry per call: whether it took it)."""
    calls = []
    attend = attention_ops.attend_with_scores
    monkeypatch.setattr(attention_ops, "attend_with_scores", lambda *a, **k: calls.append(1) or attend(*a, **k))
    return calls


def test_the_torch_backend_routes_a_decode_step_to_it_by_default(monkeypatch):
    """A CPU decode step goes through the kernel unless ``H2OCHAT_CPU_ATTENTION=0`` (read when the backend is
    chosen); ``H2OCHAT_CPU_KERNELS=none`` turns it off too."""
    calls = _counting(monkeypatch)
    generator = torch.Generator().manual_seed(7)
    query, keys, values, index, new_keys, new_values, scores = _step(1, 2, 3, 20, 64, torch.float32, generator)
    monkeypatch.delenv(attention_ops.ROUTE_SWITCH, raising=False)
    dispatch.Backend("torch").attend_with_scores(query, keys, values, index, new_keys, new_values, None, 0.1, scores)
    assert calls == [1]
    monkeypatch.setenv(attention_ops.ROUTE_SWITCH, "0")
    off = dispatch.Backend("torch")
    off.attend_with_scores(query, keys, values, index, new_keys, new_values, None, 0.1, scores)
    assert calls == [1] and not off.cpu_attention
    monkeypatch.setenv(attention_ops.ROUTE_SWITCH, "1")
    monkeypatch.setenv(dispatch.CPU_SWITCH, "none")
    assert not dispatch.Backend("torch").cpu_attention


def test_it_reads_the_slots_in_use_as_a_view():
    """With the kernel, a bf16 decode step reads the first slots in use as they are (a view: the kernel takes its
    strides), where the torch route would rather read every column than copy the view."""
    slots = torch.zeros(1, 1, 10, 4, dtype=torch.bfloat16)
    assert dispatch.Backend("torch").cpu_attention
    assert not dispatch.Backend("torch").attends_every_column(1, 9, 10, slots)
    assert dispatch.Backend("torch").attends_every_column(2, 9, 10, slots) is False  # (a chunk: the view either way)


def _op_args(dtype, decay, padding):
    generator = torch.Generator().manual_seed(11)
    query, keys, values, index, new_keys, new_values, scores = _step(2, 3, 3, 45, 64, dtype, generator, strided=True)
    new_valid = torch.tensor([[True], [False]]) if padding else None
    number, rows = (1.0, decay) if isinstance(decay, torch.Tensor) else (decay, None)
    return query, keys, values, index, new_keys, new_values, new_valid, 0.125, scores, number, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decay,padding", [(1.0, False), (0.5, True), (torch.tensor([0.5, 0.25]), False)])
def test_the_op_passes_opcheck(dtype, decay, padding):
    """The custom op a compiled step calls: its schema, its declared write of ``scores``, its fake implementation
    (shapes, dtypes) and its use under AOT autograd, as ``torch.library.opcheck`` checks them."""
    torch.library.opcheck(torch.ops.h2ochat.cpu_attend_with_scores.default, _op_args(dtype, decay, padding),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def _attend(backend, query, keys, values, index, new_keys, new_values, new_valid, scores, decay):
    return backend.attend_with_scores(query, keys, values, index, new_keys, new_values, new_valid, 0.125, scores,
                                      decay)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_call_takes_the_kernel_bit_for_bit(compiler, dtype):
    """Under ``torch.compile`` (fullgraph) the torch backend's decode step is the op, one node in the graph, and
    gives the eager kernel's output, new scores and updated scores bit for bit (the same kernel on the same
    inputs), whatever the compiler; a per-sequence decay and a padding row included."""
    from torch._dynamo.backends.registry import lookup_backend

    query, keys, values, index, new_keys, new_values, new_valid, _, scores, _, decay = _op_args(
        dtype, torch.tensor([0.5, 0.25]), True)
    backend = dispatch.Backend("torch")
    eager_scores, compiled_scores = scores.clone(), scores.clone()
    want = _attend(backend, query, keys, values, index, new_keys, new_values, new_valid, eager_scores, decay)
    targets = []

    def recording(graph, example_inputs):
        targets.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return lookup_backend(compiler)(graph, example_inputs)

    torch._dynamo.reset()
    step = torch.compile(_attend, backend=recording, fullgraph=True, dynamic=False)
    got = step(backend, query, keys, values, index, new_keys, new_values, new_valid, compiled_scores, decay)
    assert targets.count(OP) == 1, targets
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(compiled_scores, eager_scores) and not torch.equal(compiled_scores, scores)


def test_the_torch_route_is_traced_where_the_kernel_is_off(monkeypatch):
    """With the kernel switched off the compiled step traces the torch route: no op in the graph."""
    monkeypatch.setenv(attention_ops.ROUTE_SWITCH, "0")
    query, keys, values, index, new_keys, new_values, new_valid, _, scores, decay, _ = _op_args(
        torch.float32, 1.0, False)
    targets = []

    def recording(graph, example_inputs):
        targets.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    torch._dynamo.reset()
    step = torch.compile(_attend, backend=recording, fullgraph=True, dynamic=False)
    step(dispatch.Backend("torch"), query, keys, values, index, new_keys, new_values, new_valid, scores, decay)
    assert targets and OP not in targets


def _greedy(model, prompt, steps: int, slots: int):
    """Greedy decoding through an h2o cache of ``slots``: the tokens and the last logits."""
    cache = CacheSettings(budget=str(slots), recall=None).build(model)
    tokens = []
    with torch.inference_mode():
        logits = prefill(model, cache, prompt)
        for _ in range(steps):
            tokens.append(logits.argmax(-1, keepdim=True))
            logits = forward(model, cache, tokens[-1])[:, -1]
    return torch.cat(tokens, 1), logits


def test_greedy_decoding_is_the_torch_routes(family, torch_route, monkeypatch):
    """A tiny fp32 model of each family generating greedily past its cache's budget (evictions every step): the
    same tokens with the kernel as without it, the logits within fp32 rounding."""
    monkeypatch.setenv(attention_ops.ROUTE_SWITCH, "1")
    model = build_model(family, seed=2, max_position_embeddings=128)
    prompt = random_ids(2, 10, torch.Generator().manual_seed(9))
    calls = []
    attend = attention_ops.attend_with_scores

    def counted(*args, **kwargs):
        done = attend(*args, **kwargs)
        calls.append(done is not None)
        return done

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_ops, "attend_with_scores", counted)
        tokens, logits = _greedy(model, prompt, 40, 16)
    # the prompt (one chunk) and every decode step, in every layer, took the kernel
    assert all(calls) and len(calls) == (1 + 40) * model.config.num_hidden_layers
    torch_route()
    want_tokens, want_logits = _greedy(model, prompt, 40, 16)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_a_compiled_decode_step_takes_the_kernel_as_the_eager_step_does(monkeypatch):
    """The compiled decode step (aot_eager: the same capture inductor gets) holds the op once per layer, traced
    once, and both it and the eager step of a static-shape cache call the kernel once per layer and step: the same
    kernel on the same inputs, so the two give the same logits and the same scores bit for bit, step after step,
    evicting from the first."""
    from torch._dynamo.backends.registry import lookup_backend

    from h2ochat.engine import compiled
    from h2ochat.engine.forward_step import EagerDecode

    model = build_model("llama", seed=3)
    layers = model.config.num_hidden_layers
    prompt = random_ids(2, 8, torch.Generator().manual_seed(12))
    targets = []

    def recording(graph, example_inputs):
        targets.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return lookup_backend("aot_eager")(graph, example_inputs)

    torch._dynamo.reset()
    step = compiled.CompiledDecode(model, backend=recording)
    caches = [CacheSettings(budget="6", recall=None).build(model, static_shapes=True) for _ in range(2)]
    with torch.inference_mode():
        logits = [prefill(model, cache, prompt) for cache in caches][0]
    calls = []  # the kernel's calls, eager or from the op (which a trace does not enter)
    call = attention_ops._call
    monkeypatch.setattr(attention_ops, "_call", lambda *a: calls.append(1) or call(*a))
    eager = EagerDecode(model)
    for _ in range(6):
        tokens = logits.argmax(-1)
        with torch.inference_mode():
            logits = eager(caches[0], tokens.view(-1, 1))
            got = step(caches[1], tokens)
        assert torch.equal(got, logits)
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(a.scores, b.scores) and torch.equal(a.token_index, b.token_index)
    assert targets.count(OP) == layers and len(calls) == 2 * 6 * layers
