"""Packed linears (``h2ochat.engine.packed_linears``): a bf16 model on the CPU with its linear weights
packed for oneDNN gives the same bits as transformers' own linears, for every family, through the H2O
cache; a shared (tied) weight stays shared; the compiled step gets plain linears back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from h2ochat.engine.generation import CacheSettings, forward, prefill
from h2ochat.engine.packed_linears import (ENVIRONMENT_SWITCH, PackedLinear, pack_linears, packs, unpack_linears,
                                            weight_bytes)

from conftest import build_model, random_ids

pytestmark = pytest.mark.skipif(not packs(torch.device("cpu"), torch.bfloat16),
                                reason="this torch has no oneDNN linear packing")


def bf16_model(family: str, seed: int = 0):
    return build_model(family, seed=seed).to(torch.bfloat16)


def decoded(model, ids, slots: int = 8, steps: int = 12) -> torch.Tensor:
    """Logits of a prefill of ``slots`` tokens and ``steps`` teacher-forced decode steps through an H2O cache."""
    cache = CacheSettings(budget=str(slots)).build(model)
    with torch.inference_mode():
        logits = [prefill(model, cache, ids[:, :slots])]
        logits += [forward(model, cache, ids[:, t:t + 1])[:, -1] for t in range(slots, slots + steps)]
    return torch.stack(logits, 1)


def linears(model) -> tuple[int, int]:
    return (sum(type(m) is nn.Linear for m in model.modules()), sum(isinstance(m, PackedLinear) for m in model.modules()))


def test_packed_linears_give_the_same_logits_bit_for_bit_through_the_cache(family):
    ids = random_ids(2, 20, torch.Generator().manual_seed(3))
    plain = bf16_model(family)
    reference = decoded(plain, ids)
    packed = bf16_model(family)
    before = linears(packed)
    assert pack_linears(packed) == before[0] > 0
    assert linears(packed) == (0, before[0])
    assert torch.equal(decoded(packed, ids), reference)
    assert unpack_linears(packed) == before[0] and linears(packed) == before
    assert torch.equal(decoded(packed, ids), reference)


def test_a_tied_head_stays_tied_and_every_weight_byte_is_counted():
    model = bf16_model("opt")  # OPT ties its head to the token embeddings
    embeddings = model.get_input_embeddings().weight
    assert model.lm_head.weight is embeddings
    plain_bytes = weight_bytes(model)
    pack_linears(model)
    head = model.lm_head
    assert isinstance(head, PackedLinear) and model.get_input_embeddings().weight is embeddings
    # the untied weights live only packed; the tied head is a packed copy beside the embeddings
    assert weight_bytes(model) == plain_bytes + embeddings.numel() * embeddings.element_size()
    unpack_linears(model)
    assert model.lm_head.weight is embeddings and weight_bytes(model) == plain_bytes


def test_only_bf16_on_the_cpu_is_packed_and_the_switch_turns_it_off(monkeypatch):
    fp32 = build_model("llama", seed=0)
    assert pack_linears(fp32) == 0 and linears(fp32)[1] == 0
    assert not packs(torch.device("meta"), torch.bfloat16)
    monkeypatch.setenv(ENVIRONMENT_SWITCH, "0")
    off = bf16_model("llama")
    assert pack_linears(off) == 0 and linears(off)[1] == 0


def test_the_compiled_step_runs_plain_linears():
    from h2ochat.engine.compiled import CompiledDecode

    model = bf16_model("llama")
    pack_linears(model)
    CompiledDecode(model, backend="aot_eager")
    assert linears(model)[1] == 0 and linears(model)[0] > 0


def test_random_weight_loading_packs_a_bf16_model():
    from h2ochat.loading.models import load

    loaded = load("smollm2-135m", device="cpu", dtype="bfloat16", random_weights=True)
    assert linears(loaded.model)[0] == 0 and linears(loaded.model)[1] > 0
    assert loaded.weight_bytes == weight_bytes(loaded.model)
