"""The product's recall defaults compute the same tokens with the recall kernel and without it: the C kernel
changes the speed only. The options and the device class decide which steps recall, when a step chooses its
pages and which steps attend the rest of the cold pages; whether a compiled recall kernel runs does not.

The two routes sum the same products in another order (the C call by vectors of 8 or 16 floats, torch by its
matmul), so their logits agree to a stated tolerance, not bit for bit; the greedy tokens are the same."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, VOCAB, build_model
from cpu_routes import recall_route  # noqa: F401 (a fixture)

from h2ochat.config import DEFAULT_PREFILL_CHUNK, CacheSettings, Sampling
from h2ochat.engine import generation
from h2ochat.engine.generation import stream
from h2ochat.recall import rest, tier
from h2ochat.recall.tiered import DECODE_RULES, REST_AUTO, RecallConfig
from h2ochat_kernels import dispatch
from h2ochat_kernels.cpu import decode_choice as native_choice
from h2ochat_kernels.cpu import recall_ops as native

needs_kernel = pytest.mark.usefixtures("recall_route")  # on every variant this CPU runs

# the logits of the two routes, fp32: the page scores and the rest's sums differ in their last bits (the C call's
# order of fp32 additions and its exp against torch's), which the softmax and the layers after it carry on
LOGIT_TOLERANCE = dict(rtol=1e-4, atol=1e-4)
PROMPT = DEFAULT_PREFILL_CHUNK + 300  # two chunks: the second finds cold pages, chooses and attends the rest
NEW_TOKENS = 40


@pytest.fixture
def kernel_switched_off(monkeypatch):
    """``H2OCHAT_CPU_KERNELS=none`` from the call on, as on a machine whose install had no C compiler."""
    def off():
        monkeypatch.setenv(dispatch.CPU_SWITCH, "none")
        assert not native.available()
    return off


def _generate(model, ids: torch.Tensor, spy: list, monkeypatch):
    """The product's cache defaults (h2o, --recall auto: half of 128 slots in pages of 8, --selector auto,
    --recall-rest auto) in fp32, a greedy generation; returns its tokens [B, N], the logits each was drawn from
    [N, B, V] and the cache."""
    settings = CacheSettings(budget="128", recall="auto")
    cache = settings.build(model)
    config = cache.tier.config
    assert (config.slots, config.page, config.selector, config.rest) == (64, 8, "auto", "auto")
    spy.clear()
    drawn_from = []
    draw = generation.sample

    def sample(logits, *args):
        drawn_from.append(logits.clone())
        return draw(logits, *args)

    monkeypatch.setattr(generation, "sample", sample)
    steps = list(stream(model, cache, ids, max_new_tokens=NEW_TOKENS, sampling=Sampling(temperature=0.0)))
    monkeypatch.setattr(generation, "sample", draw)
    return torch.stack([step.tokens for step in steps], dim=1), torch.stack(drawn_from), cache


@needs_kernel
@pytest.mark.parametrize("family", FAMILIES)
def test_the_kernel_changes_no_token_under_the_defaults(monkeypatch, kernel_switched_off, family):
    """Tiny random OPT, Llama (GQA) and GPT-NeoX in fp32, a prompt of two chunks past a 128-slot budget: tokens are
    evicted, recalled, and the second chunk attends the rest, computed by the C call with the kernel and by the
    torch route (``recall.rest.rest_column``) without it. The same greedy tokens; logits within
    ``LOGIT_TOLERANCE`` (the routes sum in another order)."""
    model = build_model(family, seed=21, max_position_embeddings=1024)
    assert model.dtype == torch.float32
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(22))
    rests = []  # (route, query rows) of each rest column a prompt chunk attended

    c_call = native_choice.DecodeChoice.__call__

    def c_rest(self, queries, scored, rows=True, given=None):
        taken = c_call(self, queries, scored, rows, given)
        if taken and given is not None:
            rests.append(("C", queries.shape[2]))
        return taken

    torch_rest = rest.rest_column

    def torch_column(cold, frame_page, queries, scale, rotary=None):
        rests.append(("torch", queries.shape[2] * queries.shape[3]))
        return torch_rest(cold, frame_page, queries, scale, rotary)

    monkeypatch.setattr(native_choice.DecodeChoice, "__call__", c_rest)
    monkeypatch.setattr(tier, "rest_column", torch_column)
    with_kernel, with_logits, cache = _generate(model, ids, rests, monkeypatch)
    assert {route for route, _ in rests} == {"C"} and all(rows > 1 for _, rows in rests)  # (chunks only)
    stats = cache.tier.stats(cache)
    assert stats.pages_copied > 0 and stats.cold_tokens > 0
    assert all(layer.tier.decode_choice is not None for layer in cache.layers)

    kernel_switched_off()
    without, without_logits, cache = _generate(model, ids, rests, monkeypatch)
    assert {route for route, _ in rests} == {"torch"} and all(rows > 1 for _, rows in rests)
    assert all(layer.tier.decode_choice is None for layer in cache.layers)
    assert torch.equal(with_kernel, without)
    torch.testing.assert_close(with_logits, without_logits, **LOGIT_TOLERANCE)


def test_auto_attends_the_rest_in_prompt_chunks_on_every_machine():
    """``--recall-rest auto`` is ``prompt`` whatever the device and the kernel: the rule takes neither."""
    auto, off, pages, prompt = (RecallConfig(16, 4, "exact", rest=mode) for mode in ("auto", "off", "pages", "prompt"))
    assert auto.resolved_rest == REST_AUTO == "prompt"
    for config, chunk, step in ((auto, True, False), (prompt, True, False), (pages, True, True), (off, False, False)):
        assert (config.rest_attended(decoding=False), config.rest_attended(decoding=True)) == (chunk, step)


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "mps"])
def test_an_eager_step_chooses_its_pages_in_the_step_on_every_device_class(device_type):
    """The device-class rule (``RecallConfig.chooses_before``): an eager decode step, a GPU's as a CPU's, chooses
    with its own queries; only the "before" rule, or a graph captured on an accelerator (whose replay can call
    no op back), chooses before the step with the last step's queries."""
    in_step, before = (RecallConfig(16, 4, "exact", decode_rule=rule) for rule in DECODE_RULES)
    assert not in_step.chooses_before(device_type, captured=False)
    assert in_step.chooses_before(device_type, captured=True) == (device_type != "cpu")
    assert before.chooses_before(device_type, captured=False) and before.chooses_before(device_type, captured=True)


@pytest.mark.parametrize("rule", DECODE_RULES)
def test_an_eager_static_shape_step_on_a_cuda_class_device_chooses_in_the_step(monkeypatch, rule):
    """A static-shape cache (a server's buckets, eager) whose tier takes the rule as a CUDA-class device's (the
    device's type mocked: no GPU here): its decode steps choose their pages with their own queries, as a CPU's;
    by the "before" rule, with the last step's (``RecallTier.last_query``), before the step."""
    asked, chosen_with = [], []
    answer, recall = RecallConfig.chooses_before, tier.RecallTier.recall

    def as_cuda(self, device_type, captured):
        asked.append((device_type, captured))
        return answer(self, "cuda", captured)

    def spied(self, port, queries, *args, **kwargs):
        if queries.dim() == 4 and queries.shape[2] == self.last_query.shape[2]:  # (a decode step's: G queries)
            chosen_with.append("last step's" if queries is self.last_query else "its own")
        return recall(self, port, queries, *args, **kwargs)

    monkeypatch.setattr(RecallConfig, "chooses_before", as_cuda)
    monkeypatch.setattr(tier.RecallTier, "recall", spied)
    model = build_model("llama", seed=23, max_position_embeddings=512)
    cache = CacheSettings(budget="128", recall="auto", recall_decode_rule=rule).build(model, static_shapes=True)
    list(stream(model, cache, torch.randint(3, VOCAB, (1, 200), generator=torch.Generator().manual_seed(24)),
                max_new_tokens=6))
    assert set(asked) == {("cpu", False)}  # (the tier's eager steps: never a captured graph)
    assert all(layer.tier.prefetches == (rule == "before") for layer in cache.layers)
    assert set(chosen_with) == ({"last step's"} if rule == "before" else {"its own"})
