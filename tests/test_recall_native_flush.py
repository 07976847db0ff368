"""A staging page's flush in one C call (``native_store.Flusher``, ``StagingPage.flushed_natively``) against
the torch route it replaces (``RecallTier.flush``'s: the rows' entries masked, ``ColdStore.append``, then
``StagingPage.clear``), bit for bit: the store's buffers and counts, the page's columns and counts. And the C
routes that keep a store's pointers (the flush, the decode step's choice) keep no buffer of it alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import VOCAB, build_model, recall_cache
from cpu_routes import recall_route  # noqa: F401 (a fixture)

from h2ochat.engine.attention import use_h2o_attention
from h2ochat.engine.forward_step import forward
from h2ochat.engine.generation import max_positions
from h2ochat_kernels.cpu import decode_choice as native_choice
from h2ochat_kernels.cpu import recall_ops as native
from h2ochat_kernels.cpu import store_ops as native_store
from h2ochat.recall.cold_store import ColdStore
from h2ochat.recall.step import RecallSlots, StagingPage
from h2ochat.recall.tiered import RecallConfig
from h2ochat.rotary import find_rotary

needs_kernel = pytest.mark.usefixtures("recall_route")  # on every variant this CPU runs
B, H, P, D, DV = 3, 2, 4, 16, 20


def _page(dtype, generator) -> StagingPage:
    """A staging page over the last P columns of bigger slot buffers (as a layer's are views of its slots),
    some entries empty (token index -1: a row left out of a step), one row with nothing staged."""
    keys = (torch.randn(B, H, 10, D, generator=generator) * 3).to(dtype)
    values = (torch.randn(B, H, 10, DV, generator=generator) * 3).to(dtype)
    token_index = torch.randint(0, 900, (B, H, 10), generator=generator)
    token_index = token_index.masked_fill(torch.rand(B, H, 10, generator=generator) < 0.3, -1)
    token_index[2] = -1
    positions = token_index * 2 + 5
    page = StagingPage(RecallSlots(keys[:, :, -P:], values[:, :, -P:], token_index[:, :, -P:], positions[:, :, -P:]),
                       "cpu")
    page.count.copy_((page.slots.token_index >= 0).sum(dim=-1))
    page.steps = P
    return page


def _torch_flush(page: StagingPage, store: ColdStore, rows: list[int] | None) -> None:
    token_index = page.slots.token_index
    if rows is not None:
        keep = torch.zeros(B, 1, 1, dtype=torch.bool)
        keep[rows] = True
        token_index = token_index.masked_fill(~keep, -1)
    store.append(page.slots.keys, page.slots.values, token_index, page.slots.positions, reserve=False)
    page.clear(rows)


def _flushed(dtype, cold_dtype, rows_each, natively: bool):
    generator = torch.Generator().manual_seed(11)
    store = ColdStore(B, H, D, DV, 4, dtype, cold_dtype=cold_dtype)
    store.reserve(3 * P)
    pages = []
    for rows in rows_each:  # (one flush after another, into the same store)
        page = _page(dtype, generator)
        if natively:
            assert page.flushed_natively(store, rows)
        else:
            _torch_flush(page, store, rows)
        pages.append({"steps": page.steps, "count": page.count.clone(), **{
            name: tensor.clone() for name, tensor in page.slots.columns().items()}})
    return store.state_tensors(), pages


@needs_kernel
@pytest.mark.parametrize("dtype,cold_dtype", [(torch.bfloat16, "auto"), (torch.bfloat16, "model"),
                                              (torch.float32, "int8-values"), (torch.float32, "auto")])
def test_a_flush_in_one_call_is_the_torch_routes(dtype, cold_dtype):
    """Three flushes into one store (some rows, every row, one row), int8 value codes or the model's dtype, an
    fp32 model's keys rounded to bf16 (auto's)."""
    rows_each = [[0, 2], None, [1]]
    got = _flushed(dtype, cold_dtype, rows_each, natively=True)
    want = _flushed(dtype, cold_dtype, rows_each, natively=False)
    for name, tensor in want[0].items():
        held = (slice(None), slice(None), slice(0, -1)) if tensor.dim() >= 3 else ()  # (not the spill slot: never read)
        assert torch.equal(got[0][name][held], tensor[held]), name
    assert int(want[0]["count"].sum()) > 0
    for got_page, want_page in zip(got[1], want[1]):
        assert got_page["steps"] == want_page["steps"]
        for name in ("count", "token_index", "positions"):  # (an emptied column's keys and values are not read)
            assert torch.equal(got_page[name], want_page[name]), name


@needs_kernel
def test_a_flush_declines_what_the_c_append_does_not_take():
    """Quantized slots (codes and scales), or a store whose keys are int8 codes: the torch route's, untouched."""
    generator = torch.Generator().manual_seed(2)
    page = _page(torch.bfloat16, generator)
    before = page.slots.token_index.clone()
    assert not page.flushed_natively(ColdStore(B, H, D, DV, 4, torch.bfloat16, cold_dtype="int8"), None)
    assert torch.equal(page.slots.token_index, before)
    quantized = StagingPage(RecallSlots(*[getattr(page.slots, name) for name in ("keys", "values", "token_index",
                                                                                  "positions")],
                                        {"key_scale": torch.ones(B, H, P)}), "cpu")
    assert not quantized.flushed_natively(ColdStore(B, H, D, DV, 4, torch.bfloat16), None)
    assert native_store.Flusher.of({"keys": page.slots.keys}, page.count, {}, page.count) is None


@needs_kernel
def test_the_c_routes_keep_no_old_store_buffer_alive():
    """A bf16 llama's recall cache through a chunk and decode steps (its flushes and choices in C), then every
    layer's store moved to new buffers: the old ones are freed (the routes keep where the buffers are, not
    the buffers: held, a grown, narrowed or imported-over store's old buffers outlived it)."""
    model = build_model("llama", seed=4, max_position_embeddings=256).to(torch.bfloat16)
    ids = torch.randint(3, VOCAB, (2, 60), generator=torch.Generator().manual_seed(4))
    cache = recall_cache(model.config.num_hidden_layers, "h2o", 12, recall=RecallConfig(16, 4, "exact"),
                         max_positions=max_positions(model.config), positions="absolute", rotary=find_rotary(model))
    use_h2o_attention(model)
    calls = {"flush": 0, "choice": 0}
    flush, choice = native_store.Flusher.__call__, native_choice.DecodeChoice.__call__

    def counted_flush(self, *args):
        calls["flush"] += flush(self, *args)
        return True

    def counted_choice(self, *args):
        done = choice(self, *args)
        calls["choice"] += done
        return done

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_store.Flusher, "__call__", counted_flush)
        patch.setattr(native_choice.DecodeChoice, "__call__", counted_choice)
        forward(model, cache, ids[:, :30])
        for step in range(30, 60):
            forward(model, cache, ids[:, step:step + 1])
    assert calls["flush"] > 0 and calls["choice"] > 0, calls
    stores = [layer.tier.cold for layer in cache.layers]
    old = [weakref.ref(buffer) for store in stores for buffer in (store.keys, store.values, store.token_index)]
    for store in stores:
        store.reserve(store.capacity * 16)  # (past its room: copied into new buffers)
    gc.collect()
    assert all(ref() is None for ref in old)


@needs_kernel
def test_fp32_keys_round_to_bf16_as_torch_rounds_them():
    """fp32 keys appended to a store of bf16 keys in C: torch's .to(torch.bfloat16), bit for bit for finite values
    and infinities (ties to even among them), a NaN of any sign and payload still a NaN (its bits once rounded into
    the sign: -0). The same rounding takes an fp32 model's queries for bf16 keys (``h2ochat_recall_step``)."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x00000001,
                         0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFFC00000], dtype=torch.int64)
    values = bits.to(torch.int32).view(torch.float32)  # (two's complement: the same 32 bits)
    generator = torch.Generator().manual_seed(0)
    keys = torch.cat([values, torch.randn(20, generator=generator)]).view(1, 1, 2, 16)
    new = {"keys": keys, "values": torch.zeros(1, 1, 2, 4), "token_index": torch.arange(2).view(1, 1, 2),
           "positions": torch.arange(2).view(1, 1, 2)}
    store = {"keys": torch.zeros(1, 1, 3, 16, dtype=torch.bfloat16), "values": torch.zeros(1, 1, 3, 4),
             **{name: torch.zeros(1, 1, 3, dtype=torch.int32) for name in ("token_index", "positions", "encoded")},
             "value_scale": None}
    count = torch.zeros(1, 1, dtype=torch.long)
    assert native_store.cold_append(new, store, count, capacity=2) is not None
    got, want = store["keys"][0, 0, :2].flatten(), keys.flatten().to(torch.bfloat16)
    nan = want.isnan()
    assert bool(nan[:12].sum() == 5) and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
