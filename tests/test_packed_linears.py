"""The linear forms (``h2ochat.engine.packed_linears``): a bf16 model on the CPU with its linear weights
packed for oneDNN gives the same bits as transformers' own linears, for every family, through the H2O
cache, and with its few-row products on the row kernel the same logits to bf16 rounding; a shared (tied)
weight stays shared; a model moves between the forms; the compiled step runs either form as its op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from h2ochat.engine import packed_linears
from h2ochat.engine.generation import CacheSettings, forward, prefill
from h2ochat_kernels.cpu import row_products
from h2ochat.engine.packed_linears import (ENVIRONMENT_SWITCH, PackedLinear, RowLinear, form_for, pack_linears, packs,
                                            unpack_linears, weight_bytes)

from conftest import build_model, random_ids

pytestmark = pytest.mark.skipif(not packs(torch.device("cpu"), torch.bfloat16),
                                reason="this torch has no oneDNN linear packing")


KEEPS_BOTH = packed_linears.keeps_both


@pytest.fixture(autouse=True)
def packed_alone(monkeypatch):
    """The packed form alone (no plain weights kept beside it), as a machine short of memory has it: the tests
    of the packed form compare its bits with transformers' own at every row count. The tests of the packed form
    that keeps both put ``keeps_both`` back (``KEEPS_BOTH``)."""
    monkeypatch.setattr(packed_linears, "keeps_both", lambda model: False)


def bf16_model(family: str, seed: int = 0):
    return build_model(family, seed=seed).to(torch.bfloat16)


def decoded(model, ids, slots: int = 8, steps: int = 12) -> torch.Tensor:
    """Logits of a prefill of ``slots`` tokens and ``steps`` teacher-forced decode steps through an H2O cache."""
    cache = CacheSettings(budget=str(slots)).build(model)
    with torch.inference_mode():
        logits = [prefill(model, cache, ids[:, :slots])]
        logits += [forward(model, cache, ids[:, t:t + 1])[:, -1] for t in range(slots, slots + steps)]
    return torch.stack(logits, 1)


PACKED_ROWS = row_products.MAX_ROWS + 1  # a decode batch past the row kernel's: the packed form
needs_row_kernel = pytest.mark.skipif(not row_products.available(), reason=f"no row kernel: {row_products.why_not()}")


def decoded_without_eviction(model, ids, slots: int) -> torch.Tensor:
    """Logits of a prefill of half of ``ids`` and teacher-forced decode steps over the rest, in ``slots``."""
    half = ids.shape[1] // 2
    cache = CacheSettings(budget=str(slots)).build(model)
    with torch.inference_mode():
        logits = [prefill(model, cache, ids[:, :half])]
        logits += [forward(model, cache, ids[:, t:t + 1])[:, -1] for t in range(half, ids.shape[1])]
    return torch.stack(logits, 1)


def linears(model) -> tuple[int, int]:
    return (sum(type(m) is nn.Linear for m in model.modules()), sum(isinstance(m, PackedLinear) for m in model.modules()))


def row_linears(model) -> int:
    return sum(type(m) is RowLinear for m in model.modules())


def test_packed_linears_give_the_same_logits_bit_for_bit_through_the_cache(family):
    ids = random_ids(2, 20, torch.Generator().manual_seed(3))
    plain = bf16_model(family)
    reference = decoded(plain, ids)
    packed = bf16_model(family)
    before = linears(packed)
    assert pack_linears(packed, PACKED_ROWS) == before[0] > 0
    assert linears(packed) == (0, before[0])
    assert torch.equal(decoded(packed, ids), reference)
    assert unpack_linears(packed) == before[0] and linears(packed) == before
    assert torch.equal(decoded(packed, ids), reference)


def test_a_tied_head_stays_tied_and_every_weight_byte_is_counted():
    model = bf16_model("opt")  # OPT ties its head to the token embeddings
    embeddings = model.get_input_embeddings().weight
    assert model.lm_head.weight is embeddings
    plain_bytes = weight_bytes(model)
    pack_linears(model, PACKED_ROWS)
    head = model.lm_head
    assert isinstance(head, PackedLinear) and model.get_input_embeddings().weight is embeddings
    # the untied weights live only packed; the tied head is a packed copy beside the embeddings
    assert weight_bytes(model) == plain_bytes + embeddings.numel() * embeddings.element_size()
    unpack_linears(model)
    assert model.lm_head.weight is embeddings and weight_bytes(model) == plain_bytes


def test_only_bf16_on_the_cpu_is_packed_and_the_switch_turns_it_off(monkeypatch):
    fp32 = build_model("llama", seed=0)
    assert pack_linears(fp32) == 0 and linears(fp32)[1] == 0 and row_linears(fp32) == 0
    assert not packs(torch.device("meta"), torch.bfloat16)
    monkeypatch.setenv(ENVIRONMENT_SWITCH, "0")
    off = bf16_model("llama")
    assert pack_linears(off) == 0 and pack_linears(off, PACKED_ROWS) == 0 and linears(off)[1] == row_linears(off) == 0


def test_the_form_follows_the_decode_rows():
    assert form_for(PACKED_ROWS) is PackedLinear
    assert form_for(1) is form_for(row_products.MAX_ROWS) is (RowLinear if row_products.available() else PackedLinear)


@needs_row_kernel
def test_row_linears_give_the_plain_logits_to_rounding_and_share_the_weights(family):
    """Through the cache with no eviction (24 slots for 20 tokens, so a rounding difference cannot change
    which tokens are kept): the row kernel's logits are transformers' own to bf16 rounding, the weights are
    the very parameters (no copy: the same bytes, a tied head still tied)."""
    ids = random_ids(2, 20, torch.Generator().manual_seed(3))
    plain = bf16_model(family)
    cache_tokens = 24
    plain_logits = decoded_without_eviction(plain, ids, cache_tokens)
    model = bf16_model(family)
    count, plain_bytes = linears(model)[0], weight_bytes(model)
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert pack_linears(model, 1) == count and row_linears(model) == count and linears(model) == (0, 0)
    assert weight_bytes(model) == plain_bytes
    assert (model.get_input_embeddings().weight is model.get_output_embeddings().weight) == tied
    torch.testing.assert_close(decoded_without_eviction(model, ids, cache_tokens), plain_logits, atol=0.05, rtol=0.02)


@needs_row_kernel
def test_a_model_moves_between_the_forms_and_back():
    """Row form -> packed (a server that sized itself past the row kernel) -> row -> plain: the tied head
    stays tied, and the packed form's logits are the plain model's bit for bit."""
    ids = random_ids(1, 20, torch.Generator().manual_seed(4))
    model = bf16_model("opt")
    count = linears(model)[0]
    reference = decoded(bf16_model("opt"), ids)
    assert pack_linears(model, 1) == count and pack_linears(model, 1) == 0
    assert pack_linears(model, PACKED_ROWS) == count and linears(model) == (0, count)
    assert torch.equal(decoded(model, ids), reference)
    assert pack_linears(model, 1) == count and row_linears(model) == count
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert unpack_linears(model) == count and linears(model) == (count, 0)
    assert torch.equal(decoded(model, ids), reference)


def decoded_compiled(model, ids, backend: str, slots: int, steps: int, op: str) -> tuple[torch.Tensor, int]:
    """``decoded`` with the decode steps through the compiled step; and how many times the last compiled
    step ran ``op``."""
    from h2ochat.engine.compiled import CompiledDecode

    decoder = CompiledDecode(model, backend=backend)
    cache = CacheSettings(budget=str(slots)).build(model)
    with torch.inference_mode():
        logits = [prefill(model, cache, ids[:, :slots // 2])]
        logits += [decoder(cache, ids[:, t]) for t in range(slots // 2, slots // 2 + steps - 1)]
        with torch.profiler.profile() as profile:
            logits.append(decoder(cache, ids[:, slots // 2 + steps - 1]))
    ran = sum(event.name == op for event in profile.events())
    return torch.stack(logits, 1), ran


FORMS = [pytest.param(PACKED_ROWS, "h2ochat::packed_linear", id="packed"),
         pytest.param(1, "h2ochat::row_linear", id="row", marks=needs_row_kernel)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("rows, op", FORMS)
def test_the_compiled_step_runs_the_linears_as_their_op_and_gives_eagers_logits(backend, rows, op):
    """The compiled step keeps each form's weights (inductor has no lowering for packed ones as graph
    inputs; plain linears there reorder every weight on every call): each of the model's linears runs
    as its form's opaque op, and the logits are eager's. aot_eager runs the same products bit for bit;
    inductor fuses the rest of the step, so bf16 rounding differs there. No eviction (32 slots for 24
    tokens): a rounding difference cannot change which tokens are kept."""
    layers = {"num_hidden_layers": 1} if backend == "inductor" else {}  # inductor's C++ takes long per layer
    model = build_model("llama", seed=6, **layers).to(torch.bfloat16)
    count = pack_linears(model, rows)
    ids = random_ids(2, 24, torch.Generator().manual_seed(5))
    eager_cache = CacheSettings(budget="32").build(model)
    with torch.inference_mode():
        eager = [prefill(model, eager_cache, ids[:, :16])]
        eager += [forward(model, eager_cache, ids[:, t:t + 1])[:, -1] for t in range(16, 24)]
    compiled, ran = decoded_compiled(model, ids, backend, slots=32, steps=8, op=op)
    assert linears(model)[0] == 0 and ran == count
    if backend == "aot_eager":
        assert torch.equal(compiled, torch.stack(eager, 1))
    else:
        torch.testing.assert_close(compiled, torch.stack(eager, 1), atol=0.05, rtol=0.05)


def test_random_weight_loading_packs_a_bf16_model():
    from h2ochat.loading.models import load

    loaded = load("smollm2-135m", device="cpu", dtype="bfloat16", random_weights=True)
    form = form_for(1)
    assert linears(loaded.model)[0] == 0 and sum(type(m) is form for m in loaded.model.modules()) > 0
    assert loaded.weight_bytes == weight_bytes(loaded.model)


@needs_row_kernel
def test_a_packed_model_keeps_its_plain_weights_for_few_rows_where_memory_allows(monkeypatch):
    """A server's packed form with the plain weights kept too (``keeps_both``): a step of one to
    ``MAX_ROWS`` rows gives the row form's logits bit for bit, a larger one the packed form's, the tied head stays
    tied and the kept weights are counted; with little free memory the packed form keeps none."""
    ids = random_ids(PACKED_ROWS, 20, torch.Generator().manual_seed(8))
    row_model, packed_model, both = bf16_model("opt"), bf16_model("opt"), bf16_model("opt")
    count, plain_bytes = linears(both)[0], weight_bytes(both)
    embeddings = both.get_input_embeddings().weight
    pack_linears(row_model, 1)
    pack_linears(packed_model, PACKED_ROWS)
    monkeypatch.setattr(packed_linears, "keeps_both", KEEPS_BOTH)
    assert pack_linears(both, PACKED_ROWS) == count and linears(both) == (0, count)
    assert all(m.plain_weight is not None for m in both.modules() if isinstance(m, PackedLinear))
    assert both.lm_head._shared_weight[0] is embeddings
    packed_bytes = weight_bytes(packed_model)
    fresh = bf16_model("opt")  # the linears' own weights, the tied head's (the embeddings) left out
    kept = sum(m.weight.numel() * m.weight.element_size() for m in fresh.modules()
               if type(m) is nn.Linear and m.weight is not fresh.get_input_embeddings().weight)
    assert weight_bytes(both) == packed_bytes + kept
    assert "row kernel at" in packed_linears.form_of(both) and packed_linears.form_of(packed_model) == "packed"
    few, many = ids[:1], ids
    assert torch.equal(decoded(both, few), decoded(row_model, few))
    assert torch.equal(decoded(both, many), decoded(packed_model, many))
    assert pack_linears(both, PACKED_ROWS) == 0  # (already in that form)
    monkeypatch.setattr(packed_linears, "free_host_bytes", lambda: plain_bytes)
    assert not packed_linears.keeps_both(bf16_model("opt"))
    assert pack_linears(both, PACKED_ROWS) == count and packed_linears.form_of(both) == "packed"
    assert torch.equal(decoded(both, many), decoded(packed_model, many))


@needs_row_kernel
@pytest.mark.parametrize("rows", [1, PACKED_ROWS])
def test_the_compiled_step_takes_the_few_row_product_of_a_packed_model_that_keeps_both(rows, monkeypatch):
    """The op decides on the rows per call (no guard on the batch size): the compiled step gives eager's logits
    bit for bit (aot_eager) at one row and past the row kernel's rows."""
    monkeypatch.setattr(packed_linears, "keeps_both", KEEPS_BOTH)
    model = build_model("llama", seed=6).to(torch.bfloat16)
    count = pack_linears(model, PACKED_ROWS)
    assert all(m.plain_weight is not None for m in model.modules() if isinstance(m, PackedLinear))
    ids = random_ids(rows, 24, torch.Generator().manual_seed(5))
    eager_cache = CacheSettings(budget="32").build(model)
    with torch.inference_mode():
        eager = [prefill(model, eager_cache, ids[:, :16])]
        eager += [forward(model, eager_cache, ids[:, t:t + 1])[:, -1] for t in range(16, 24)]
    compiled, ran = decoded_compiled(model, ids, "aot_eager", slots=32, steps=8, op="h2ochat::packed_linear")
    assert ran == count and torch.equal(compiled, torch.stack(eager, 1))
