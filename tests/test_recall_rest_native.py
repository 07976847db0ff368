"""The rest column from the recall step's C call (``native_choice.DecodeChoice`` with ``rest_scale``: the q.k its
choice computed, ``rest_row`` in recall_kernel.c) against the torch route (``recall.rest.rest_column``), on
the states a bf16 or fp32 recall cache reaches: int8-value and bf16 cold pages, groups of 1, 3 and 4 query heads,
head dims with and without a tail, part pages, pages in the frames, rows holding nothing."""

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
from h2ochat.recall.rest import rest_column
from h2ochat.recall.tier import RecallTier
from h2ochat.recall.tiered import RecallConfig
from h2ochat.rotary import find_rotary

needs_kernel = pytest.mark.usefixtures("recall_route")  # on every variant this CPU runs
DTYPES = [torch.bfloat16, torch.float32]  # (fp32: --dtype auto's on a CPU without native bf16)


def _fed_cache(model, ids, cold_dtype, rest="pages", page=4, chunk_ends=(30,)):
    """A bf16 recall cache (8 policy slots, 4 pages of ``page`` recalling) after prompt chunks (a 30-token one:
    nothing cold yet) and decode steps."""
    cache = recall_cache(model.config.num_hidden_layers, "h2o", 8,
                         recall=RecallConfig(4 * page, page, "exact", cold_dtype=cold_dtype, rest=rest),
                         max_positions=max_positions(model.config), positions="absolute", rotary=find_rotary(model))
    use_h2o_attention(model)
    logits = [forward(model, cache, ids[:, a:b], logits_to_keep=1)[:, -1] for a, b in zip((0, *chunk_ends), chunk_ends)]
    logits += [forward(model, cache, ids[:, i:i + 1], logits_to_keep=1)[:, -1] for i in range(chunk_ends[-1], ids.shape[1])]
    return cache, torch.stack(logits)


def _c_rest_against_torch(layer, query, scale, rows=False):
    """The layer's C call for ``query`` [B, H, G, Q, D] (``rows``: which choose; False: none, the rest only;
    Q > 1: a chunk's, handed over group-major), its rest against the torch rest after it; returns the C rest."""
    tier = layer.tier
    scored = tier.digest.scored_slots(layer.port.tokens_fed_with_padding)
    assert tier.decode_choice(query.flatten(2, 3), scored, rows, (scale, tier.page_means))
    got = tier.decode_choice.rest_as(query.shape[:4])
    want = rest_column(tier.cold, tier.frames.frame_page, query, scale)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    return got


def _queries(model, batch, generator, q_len=1):
    """Queries [B, H, G, Q, D] for a step of ``model``'s layers (its dtype, spread as a model's are): a decode
    step's (Q = 1) or a chunk's."""
    config = model.config
    kv_heads, group = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (torch.randn(batch, kv_heads, group, q_len, head_dim, generator=generator) * 4).to(model.dtype)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,cold_dtype,page", [
    (6, 2, 64, "auto", 4), (6, 2, 64, "model", 4), (4, 4, 40, "auto", 4), (4, 1, 16, "model", 4),
    (6, 2, 64, "auto", 3), (6, 2, 64, "auto", 16), (6, 2, 64, "auto", 1)])  # (pages summed by lanes, or one by one)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_c_rest_is_the_torch_rest(heads, kv_heads, head_dim, cold_dtype, page, dtype):
    model = build_model("llama", seed=3, max_position_embeddings=256, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim).to(dtype)
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(3, VOCAB, (3, 90 if page == 16 else 60), generator=generator)
    cache, _ = _fed_cache(model, ids, cold_dtype, page=page)
    part_pages = 0
    for layer in cache.layers:
        tier = layer.tier
        with torch.inference_mode():  # (as the steps ran)
            tier.cold.count[1] = 0  # (a row that holds nothing: its rest is -inf)
        part_pages += int((tier.cold.count % tier.cold.page != 0).sum())
        frames = tier.frames.frame_page.clone()
        got = _c_rest_against_torch(layer, _queries(model, 3, generator), 0.125)  # (no row chooses: the rest only)
        _c_rest_against_torch(layer, _queries(model, 3, generator, q_len=5), 0.125)  # (a chunk's: the block path)
        assert torch.equal(tier.frames.frame_page, frames)
        assert bool((got[0][1] == float("-inf")).all()) and bool((got[1][1] == 0).all())
        assert bool(torch.isfinite(got[0][0]).all()) and bool((frames[0] >= 0).any())  # (pages in the frames)
    assert part_pages > 0 or page == 1


@needs_kernel
def test_a_choosing_steps_rest_is_the_torch_rest_after_the_same_choice():
    """The rest a choosing row gets from the choice's own q.k, against the torch rest after the same choice
    (every row choosing, then some)."""
    model = build_model("llama", seed=4, max_position_embeddings=256).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(12)
    cache, _ = _fed_cache(model, torch.randint(3, VOCAB, (2, 50), generator=generator), "auto")
    for rows in (True, [False, True]):
        for layer in cache.layers:
            _c_rest_against_torch(layer, _queries(model, 2, generator), 0.3, rows)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_cache_with_the_rest_decodes_as_with_the_torch_rest(monkeypatch, dtype):
    """The whole cache, bf16 or fp32: the C rest in every decode step (spied), the logits of the torch route's
    to bf16's rounding (the attention sums the same column; which tokens are evicted stays the same)."""
    model = build_model("llama", seed=5, max_position_embeddings=256).to(dtype)
    ids = torch.randint(3, VOCAB, (2, 60), generator=torch.Generator().manual_seed(13))
    rests = []
    call = native_choice.DecodeChoice.__call__

    def spied(self, queries, scored, rows=True, rest=None):
        taken = call(self, queries, scored, rows, rest)
        rests.append(taken and self.rest is not None)
        return taken

    monkeypatch.setattr(native_choice.DecodeChoice, "__call__", spied)
    with_kernel, got = _fed_cache(model, ids, "auto")
    assert sum(rests) > len(rests) // 2
    monkeypatch.setenv("H2OCHAT_CPU_KERNELS", "none")
    without, want = _fed_cache(model, ids, "auto")
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    _, no_rest = _fed_cache(model, ids, "auto", rest="off")
    assert not torch.allclose(no_rest, want, rtol=2e-2, atol=2e-2)
    for a, b in zip(with_kernel.layers, without.layers):
        assert torch.equal(a.token_index, b.token_index)


@needs_kernel
@pytest.mark.parametrize("family,grouped", [("llama", {"num_attention_heads": 6, "num_key_value_heads": 2}),
                                             ("neox", {})])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_chunks_rest_comes_from_the_c_call_as_the_torch_rest(monkeypatch, family, grouped, dtype):
    """``--recall-rest prompt`` in a bf16 cache: a prompt chunk after others made pages cold takes its rest from
    the choice's C call (its queries handed over group-major, G * Q of them). The first layer's rest columns
    (the same state either way) are the torch route's to fp32 rounding, each query row's own; the logits
    are the torch route's to bf16's rounding; without the rest they differ."""
    model = build_model(family, seed=9, max_position_embeddings=256, **grouped).to(dtype)
    ids = torch.randint(3, VOCAB, (2, 90), generator=torch.Generator().manual_seed(17))
    layers = model.config.num_hidden_layers
    columns = []  # (each chunk's rest columns, layer by layer)
    attend = RecallTier.before_attention

    def spied(self, port, query, new_valid, scale, context):
        column = attend(self, port, query, new_valid, scale, context)
        columns.append(None if column is None else [part.clone() for part in column])  # (the C call's: its buffers)
        return column

    def fed(rest):
        columns.clear()
        cache = recall_cache(layers, "h2o", 8, recall=RecallConfig(16, 4, "exact", rest=rest),
                             max_positions=max_positions(model.config), positions="absolute", rotary=find_rotary(model))
        use_h2o_attention(model)
        logits = torch.cat([forward(model, cache, ids[:, a:b])[:, -5:] for a, b in ((0, 30), (30, 60), (60, 90))])
        return logits, list(columns), [layer.tier.decode_choice is not None for layer in cache.layers]

    monkeypatch.setattr(RecallTier, "before_attention", spied)
    got, got_columns, native_layers = fed("prompt")
    assert all(native_layers)
    monkeypatch.setenv("H2OCHAT_CPU_KERNELS", "none")
    (want, want_columns, _), (without, _, _) = fed("prompt"), fed("off")
    for chunk in (1, 2):  # (the first chunk finds nothing cold)
        first = chunk * layers
        assert got_columns[first] is not None and got_columns[first][0].shape[-1] == 30
        torch.testing.assert_close(got_columns[first], want_columns[first], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(without, want, rtol=2e-2, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize("move", ["import", "reset"])
def test_a_rows_page_means_follow_its_import_and_reset(move):
    """The C rest keeps each full page's mean (``native_choice.PageMeans``): a row that takes another
    conversation (imported) or starts again (reset, then a chunk longer than the old one) gets the means of
    its new values, as the torch rest reads them."""
    model = build_model("llama", seed=6, max_position_embeddings=256).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(14)
    ids = torch.randint(3, VOCAB, (2, 50), generator=generator)
    cache, _ = _fed_cache(model, ids, "auto")
    if move == "import":
        cache.import_row(0, cache.export_row(1))
    else:
        cache.reset_row(0)
        longer = torch.randint(3, VOCAB, (2, 90), generator=generator)  # (more cold pages than it had)
        with torch.inference_mode():
            forward(model, cache, longer, logits_to_keep=1)
    for layer in cache.layers:
        _c_rest_against_torch(layer, _queries(model, 2, generator), 0.3)


# the logits of the C route against the torch route's (the same rest and choice, summed in another order): fp32
# to its last bits, carried through the layers; bf16 to its rounding, as the tests above
ROUTE_TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.usefixtures("without_attention_kernel")  # (the attention kernel sums in another order)
@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_attends_the_rest_in_prompt_chunks_with_the_kernel_or_without(monkeypatch, dtype):
    """``--recall-rest auto`` is ``prompt`` (the rest in prompt chunks) on every machine: with the kernel, the C
    call computes it, without it (``H2OCHAT_CPU_KERNELS=none``, no C compiler at install, or a call it declines) the torch
    route does. Within one route auto decodes as prompt bit for bit, not as ``off`` nor ``pages``; across the
    routes the tokens (the logits' argmax) are the same and the logits agree within ``ROUTE_TOLERANCE``."""
    model = build_model("llama", seed=7, max_position_embeddings=256).to(dtype)
    ids = torch.randint(3, VOCAB, (2, 80), generator=torch.Generator().manual_seed(15))
    chunks = (30, 55)  # (the second chunk finds cold pages)

    def modes():
        return {rest: _fed_cache(model, ids, "auto", rest=rest, chunk_ends=chunks)[1]
                for rest in ("auto", "prompt", "pages", "off")}

    def as_prompt(logits):
        assert torch.equal(logits["auto"], logits["prompt"]) and not torch.equal(logits["auto"][:2], logits["off"][:2])
        assert torch.equal(logits["pages"][:2], logits["auto"][:2]) and not torch.equal(logits["auto"], logits["pages"])

    with_kernel = modes()
    as_prompt(with_kernel)
    monkeypatch.setattr(native_choice.DecodeChoice, "__call__", lambda *args: False)  # (a call it declines)
    declined = modes()
    as_prompt(declined)
    monkeypatch.undo()
    monkeypatch.setenv("H2OCHAT_CPU_KERNELS", "none")
    without = modes()
    as_prompt(without)
    assert torch.equal(declined["auto"], without["auto"])  # (the torch route either way)
    torch.testing.assert_close(with_kernel["auto"], without["auto"], **ROUTE_TOLERANCE[dtype])
    assert torch.equal(with_kernel["auto"].argmax(-1), without["auto"].argmax(-1))
