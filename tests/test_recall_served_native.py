"""The recall step's C route (``h2ochat_kernels.cpu.recall_ops``) on a server's decode steps, where some rows are
left out (``active``: a server's free rows) or only some rows choose (``RowCadence``): a bf16 llama's
recall cache with the kernels against the same cache without them (the torch route), bit for bit: the
logits, every state tensor of every layer (slots, frames, cold store, staging page, statistics)."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build_model, recall_cache
from cpu_routes import recall_route, without_attention_kernel  # noqa: F401 (fixtures)

from h2ochat.engine.attention import use_h2o_attention
from h2ochat.engine.forward_step import forward
from h2ochat.engine.generation import max_positions
from h2ochat_kernels.cpu import decode_choice as native_choice
from h2ochat_kernels.cpu import recall_ops as native
from h2ochat_kernels.cpu import store_ops as native_store
from h2ochat.recall.tiered import RecallConfig
from h2ochat.rotary import find_rotary

needs_kernel = pytest.mark.usefixtures("recall_route")  # on every variant this CPU runs
BATCH, PROMPT, STEPS = 4, 30, 48


def _masks(seed: int) -> list[torch.Tensor | None]:
    """Each decode step's active rows: every row now and then, a row out for a stretch, a row that leaves
    for good (a free row at the end of the bucket), a row in the middle out at random, no row at all once."""
    generator = torch.Generator().manual_seed(seed)
    masks = []
    for step in range(STEPS):
        active = torch.rand(BATCH, generator=generator) > 0.25
        active[0] = not 10 <= step < 19
        active[BATCH - 1] = step < 30
        masks.append(None if step % 11 == 0 else active)
    masks[33] = torch.zeros(BATCH, dtype=torch.bool)
    return masks


def _snapshot(cache) -> dict[str, torch.Tensor]:
    """Every layer's state tensors; the cold store's without its spill slot (the last: the torch route's
    append writes the entries it skips there, the C route none; never read)."""
    return {f"{index}.{name}": (tensor[:, :, :-1] if name.startswith("cold_") and tensor.dim() >= 3 else tensor).clone()
            for index, layer in enumerate(cache.layers) for name, tensor in layer.state_tensors().items()}


def _run(model, ids, masks, every: int, cold_dtype: str, kv_dtype: str):
    cache = recall_cache(model.config.num_hidden_layers, "h2o", 12, kv_dtype=kv_dtype,
                         recall=RecallConfig(16, 4, "exact", cold_dtype=cold_dtype, every=every),
                         max_positions=max_positions(model.config), positions="absolute", rotary=find_rotary(model))
    use_h2o_attention(model)
    forward(model, cache, ids[:, :PROMPT], logits_to_keep=1)
    logits, states = [], []
    for step, active in enumerate(masks):
        token = ids[:, PROMPT + step:PROMPT + step + 1]
        logits.append(forward(model, cache, token, logits_to_keep=1, active=active)[:, -1])
        states.append(_snapshot(cache))
    return logits, states, sum(int(layer.tier.frames.copied.sum()) for layer in cache.layers)


@pytest.mark.usefixtures("without_attention_kernel")  # (the attention kernel sums in another order)
@needs_kernel
@pytest.mark.parametrize("every,cold_dtype,kv_dtype,dtype", [
    (1, "auto", "auto", torch.bfloat16), (3, "model", "auto", torch.bfloat16), (1, "auto", "int8", torch.bfloat16),
    (2, "model", "int8", torch.bfloat16), (1, "auto", "int4", torch.bfloat16), (1, "auto", "auto", torch.float32),
    (2, "model", "int8", torch.float32)])
def test_steps_with_rows_left_out_are_the_torch_routes(without_kernel, monkeypatch, every, cold_dtype, kv_dtype, dtype):
    """48 decode steps of 4 rows, some left out of most steps (``_masks``), after a 30-token prompt, in bf16
    slots or quantized ones: the kernels' route (the choice of only some rows and the staging with rows left
    out in one C call each; int8 codes and scales encoded in C as the layer encodes them; int4: the staging
    only; the flushes of some rows' staging pages in one C call, float slots) gives the torch route's logits and
    state after every step, and it did run on the masked steps; an fp32 model's too (the choice by portable
    vectors in either build)."""
    model = build_model("llama", seed=5, max_position_embeddings=256).to(dtype)
    ids = torch.randint(3, VOCAB, (BATCH, PROMPT + STEPS), generator=torch.Generator().manual_seed(5))
    masks = _masks(every)
    calls = {"choice": 0, "stage": 0, "flush": 0}
    choice, stage, flush = native_choice.DecodeChoice.__call__, native.Stager.__call__, native_store.Flusher.__call__

    def counted_choice(self, queries, scored, rows=True, rest=None):
        done = choice(self, queries, scored, rows, rest)
        calls["choice"] += done and rows is not True
        return done

    def counted_stage(self, slot, active=None):
        done = stage(self, slot, active)
        calls["stage"] += done and active is not None
        return done

    def counted_flush(self, store, count, capacity, rows=None):
        done = flush(self, store, count, capacity, rows)
        calls["flush"] += done and rows is not None
        return done

    monkeypatch.setattr(native_choice.DecodeChoice, "__call__", counted_choice)
    monkeypatch.setattr(native_store.Flusher, "__call__", counted_flush)
    monkeypatch.setattr(native.Stager, "__call__", counted_stage)
    got = _run(model, ids, masks, every, cold_dtype, kv_dtype)
    assert (calls["choice"] > 0 or kv_dtype == "int4") and calls["stage"] > 0, calls
    assert calls["flush"] > 0 or kv_dtype != "auto", calls  # (quantized slots flush by the torch route)
    without_kernel()
    want = _run(model, ids, masks, every, cold_dtype, kv_dtype)
    assert got[2] == want[2] and got[2] > 0
    for step, active in enumerate(masks):
        assert torch.equal(got[0][step], want[0][step]), f"step {step} logits"
        assert got[1][step].keys() == want[1][step].keys()
        for name, tensor in want[1][step].items():
            assert torch.equal(got[1][step][name], tensor), f"step {step} (active {active}): {name} differs"


@pytest.fixture
def without_kernel(monkeypatch):
    """The torch routes only, from the call on (as on a CPU where the kernel does not build)."""
    def off():
        monkeypatch.setenv("H2OCHAT_CPU_KERNELS", "none")
    return off

