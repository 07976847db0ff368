"""The recall step's C kernels (``h2ochat_kernels.cpu.recall_ops``) against the torch routes they replace on a
CPU: page scores against the torch reference (fp64 sums as the yardstick), the best pages against the digest's
torch route, and a bf16 or fp32 model's recall cache with the kernels against the same cache without them.
Every test runs on every variant this CPU runs (``cpu_routes``: avx512bf16, avx2, generic), each skipped with
its reason where the CPU or the install lacks it. Bit-for-bit claims hold within one variant; across variants
(and against torch) the sums are added in another order, within the tolerances each test states."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build_model, recall_cache
from cpu_routes import install_had_a_compiler, recall_route, torch_route, without_attention_kernel  # noqa: F401 (fixtures)

from h2ochat.engine.attention import use_h2o_attention
from h2ochat.engine.forward_step import forward
from h2ochat.engine.generation import max_positions
from h2ochat_kernels import dispatch
from h2ochat_kernels.cpu import binding, row_products, variants
from h2ochat_kernels.cpu import decode_choice as native_choice
from h2ochat_kernels.cpu import recall_ops as native
from h2ochat.recall.digests import KeyCodes
from h2ochat.recall.tiered import RecallConfig
from h2ochat.rotary import find_rotary
from h2ochat_kernels.recall_reference import page_scores, top_pages

# every test here on every variant this CPU runs, the attention on the torch route (its kernel sums in another order)
pytestmark = pytest.mark.usefixtures("recall_route", "without_attention_kernel")


def test_every_variant_this_cpu_runs_was_built():
    """(Else its tests would skip: a variant that stopped building goes unnoticed.) An install without a C
    compiler builds none, and runs the torch route."""
    if not install_had_a_compiler():
        pytest.skip("no C compiler: the install built no CPU kernel")
    for variant in variants.VARIANTS:
        if dispatch.cpu_runs(variant):
            assert binding.built(variant) is not None, variant.extension


def test_the_switch_turns_every_kernel_off(torch_route):
    """``H2OCHAT_CPU_KERNELS=none`` is the one switch for every compiled CPU kernel."""
    torch_route()
    assert not native.available() and "H2OCHAT_CPU_KERNELS=none" in native.why_not()
    assert not row_products.available()


def test_the_route_is_the_variant_asked_for(recall_route):
    kernels = native.bound()
    assert kernels is not None, native.why_not()
    assert kernels.library.variant.name == recall_route
    assert kernels.bf16_dots == (recall_route == "avx512bf16")


@pytest.fixture
def without_kernel(torch_route):
    """The torch routes only, from the call on (as on a CPU where no variant runs)."""
    return torch_route


DTYPES = [torch.bfloat16, torch.float32]  # a model's on a CPU: with native bf16, and --dtype auto's without


def _floats(*shape, generator, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries,dim", [(1, 64), (3, 64), (5, 67), (16, 128)])
def test_page_best_is_the_reference_to_fp32_rounding(queries, dim, dtype):
    generator = torch.Generator().manual_seed(queries * dim)
    store = _floats(2, 3, 130, dim + 5, generator=generator, dtype=dtype)
    keys = store[:, :, :96, :dim]  # a view of a bigger store, as the digest scores it
    q = _floats(2, 3, queries, dim, generator=generator, dtype=dtype)
    valid = torch.rand(2, 3, 96, generator=generator) > 0.2
    valid[0, 1, 16:24] = False  # an empty page
    got = native.page_best(q, keys, valid, 8)
    dots = torch.einsum("bhmd,bhtd->bhmt", q.double(), keys.double()).amax(dim=2).masked_fill(~valid, float("-inf"))
    exact = dots.view(2, 3, 12, 8).amax(dim=-1)  # the best q.k per page, summed in fp64
    finite = exact.isfinite()
    assert torch.equal(got.isfinite(), finite) and bool((got[0, 1, 2] == float("-inf")))
    torch.testing.assert_close(got[finite].double(), exact[finite], rtol=1e-6, atol=1e-5)
    reference = page_scores(q, keys, None, None, valid, 8)
    assert torch.equal(top_pages(got, 5), top_pages(reference, 5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries", [6, 17, 100, 900])
@pytest.mark.parametrize("dim", [64, 40, 67])
def test_a_chunks_page_scores_are_the_fp64_sums(queries, dim, dtype):
    """A prompt chunk's many queries (by blocks of 16 keys in C): head dims a multiple of 32, not one, odd;
    104 slots (a last block of 8 keys), a view of a bigger store, invalid slots and an empty page; then the
    best pages of a store holding 0, 5 (a part page), 61 and all of its slots (-1 past the pages held)."""
    generator = torch.Generator().manual_seed(queries + dim)
    store = _floats(2, 3, 140, dim + 7, generator=generator, dtype=dtype)
    keys = store[:, :, 8:112, 3:dim + 3]
    q = _floats(2, 3, queries, dim, generator=generator, dtype=dtype)
    valid = torch.rand(2, 3, 104, generator=generator) > 0.3
    valid[1, 2, 96:] = False  # an empty page in the last block
    dots = torch.einsum("bhmd,bhtd->bhmt", q.double(), keys.double()).amax(dim=2)

    def exact(valid):  # the best q.k per page, summed in fp64
        return dots.masked_fill(~valid, float("-inf")).view(2, 3, 13, 8).amax(dim=-1)

    got, want = native.page_best(q, keys, valid, 8), exact(valid)
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite) and bool(got[1, 2, 12] == float("-inf"))
    torch.testing.assert_close(got[finite].double(), want[finite], rtol=1e-6, atol=1e-5)
    count = torch.tensor([[0, 5, 61], [104, 130, 1]])
    held = torch.arange(104) < count.unsqueeze(-1)
    wanted = native.top_pages(q, keys, count, 8, 9)
    assert torch.equal(wanted, top_pages(exact(held), 9))
    assert bool((wanted[0, 0] == -1).all()) and bool((wanted[0, 1, 1:] == -1).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries", [1, 2, 3, 5])
@pytest.mark.parametrize("dim", [64, 128, 40, 67])
def test_a_decode_steps_page_scores_are_the_fp64_sums(queries, dim, dtype):
    """A decode step's few queries (16 keys at a time in C, each query's per-key sums added across lanes):
    head dims a multiple of 32 (the two C has as constants), not one, odd; 120 slots of a view of a bigger
    store (a last block of 8), invalid slots, a whole block invalid and an empty page; pages of 8 and 16
    (a block's tree of maxima), 4 and 24 (lane ranges; a page across blocks); then the best pages of stores
    holding 0, 5, 61, all and more than all of their slots, and of one of over 256 pages (scored 256 at a
    time)."""
    generator = torch.Generator().manual_seed(10 * queries + dim)
    store = _floats(2, 3, 150, dim + 7, generator=generator, dtype=dtype)
    keys = store[:, :, 5:125, 2:dim + 2]
    q = _floats(2, 3, queries, dim, generator=generator, dtype=dtype)
    valid = torch.rand(2, 3, 120, generator=generator) > 0.3
    valid[0, 1, 32:48] = False  # a block with no valid slot
    valid[1, 2, 96:104] = False  # an empty page of 8
    dots = torch.einsum("bhmd,bhtd->bhmt", q.double(), keys.double()).amax(dim=2)

    def exact(valid, page, tokens=120):  # the best q.k per page, summed in fp64
        return dots[..., :tokens].masked_fill(~valid[..., :tokens], float("-inf")).view(2, 3, -1, page).amax(dim=-1)

    for page, tokens in ((8, 120), (16, 112), (4, 120), (24, 120)):
        got, want = native.page_best(q, keys[:, :, :tokens], valid[..., :tokens], page), exact(valid, page, tokens)
        finite = want.isfinite()
        assert torch.equal(got.isfinite(), finite) and (page > 16 or not finite.all()), page  # (-inf: the block)
        torch.testing.assert_close(got[finite].double(), want[finite], rtol=1e-6, atol=1e-5)
    assert bool(native.page_best(q, keys, valid, 8)[1, 2, 12] == float("-inf"))
    count = torch.tensor([[0, 5, 61], [120, 130, 17]])
    held = torch.arange(120) < count.unsqueeze(-1)
    wanted = native.top_pages(q, keys, count, 8, 9)
    assert torch.equal(wanted, top_pages(exact(held, 8), 9)) and bool((wanted[0, 0] == -1).all())
    many_pages = _floats(1, 2, 620, dim, generator=generator, dtype=dtype)[:, :, :600]
    q = q[:1, :2]
    dots = torch.einsum("bhmd,bhtd->bhmt", q.double(), many_pages.double()).amax(dim=2)
    count = torch.tensor([[599, 300]])
    held = torch.arange(600) < count.unsqueeze(-1)
    want = dots.masked_fill(~held, float("-inf")).view(1, 2, 300, 2).amax(dim=-1)
    assert torch.equal(native.top_pages(q, many_pages, count, 2, 6), top_pages(want, 6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries", [2, 3, 4, 6, 7, 8])
@pytest.mark.parametrize("dim", [64, 40, 67])
def test_a_few_queries_score_as_each_alone(queries, dim, dtype):
    """A decode step's few queries (fp32 by vectors of 8 floats in either build; bf16 in the portable build by
    each key's channels split in place, groups of keys read once for every query): the page scores of M queries
    are the largest of each query's alone, bit for bit (the same sums in the same order), over a view of a bigger
    store, head dims a multiple of 16 and not (keys then from a padded copy), invalid slots and a last part block."""
    generator = torch.Generator().manual_seed(queries + dim)
    keys = _floats(2, 3, 140, dim + 5, generator=generator, dtype=dtype)[:, :, 3:107, 1:dim + 1]
    q = _floats(2, 3, queries, dim, generator=generator, dtype=dtype)
    valid = torch.rand(2, 3, 104, generator=generator) > 0.2
    for page in (8, 4):  # (pages of 4: two a block of 8 keys, so each key's lane counts)
        alone = torch.stack([native.page_best(q[:, :, m:m + 1], keys, valid, page) for m in range(queries)]).amax(dim=0)
        assert torch.equal(native.page_best(q, keys, valid, page), alone), page


def test_page_best_declines_what_it_does_not_take():
    q = torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16)
    keys = torch.zeros(1, 1, 16, 8, dtype=torch.bfloat16)
    valid = torch.ones(1, 1, 16, dtype=torch.bool)
    assert native.page_best(q.half(), keys.half(), valid, 8) is None  # fp16: the reference's
    assert native.page_best(q.float(), keys, valid, 8) is None  # queries and keys of two dtypes
    assert native.page_best(q[..., :4], keys[..., ::2], valid, 8) is None  # keys with gaps along D
    assert native.page_best(q, keys[:, :, :12], valid[:, :, :12], 8) is None  # a part page


def _digest(counts, generator, dim=64, page=8, slots=200, dtype=torch.bfloat16):
    digest = KeyCodes(len(counts), len(counts[0]), dim, page, None, dtype=dtype)
    digest.reserve(slots)
    keys = _floats(len(counts), len(counts[0]), slots, dim, generator=generator, dtype=dtype)
    index = torch.tensor([[list(range(c)) + [-1] * (slots - c) for c in row] for row in counts])
    digest.append(keys, index)
    return digest


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("upto,queries", [(None, 3), (100, 3), (13, 3), (None, 1), (100, 5), (None, 100),
                                          (13, 100)])
def test_top_pages_is_the_digests_torch_route(without_kernel, upto, queries, dtype):
    """Rows and heads holding nothing, a part page, fewer pages than wanted; ``upto`` cutting the scored
    slots; a decode step's queries and a prompt chunk's."""
    generator = torch.Generator().manual_seed(7)
    digest = _digest([[0, 5, 197], [64, 130, 9]], generator, dtype=dtype)
    q = _floats(2, 3, queries, 64, generator=generator, dtype=dtype)
    got = [digest.top_pages(q, k, upto=upto) for k in (1, 7, 40)]
    without_kernel()
    want = [digest.top_pages(q, k, upto=upto) for k in (1, 7, 40)]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _run_recall_cache(model, ids, cold_dtype="auto"):
    cache = recall_cache(model.config.num_hidden_layers, "h2o", 12,
                         recall=RecallConfig(16, 4, "exact", cold_dtype=cold_dtype),
                         max_positions=max_positions(model.config), positions="absolute", rotary=find_rotary(model))
    use_h2o_attention(model)
    logits = [forward(model, cache, ids[:, :30], logits_to_keep=1)[:, -1]]
    logits += [forward(model, cache, ids[:, i:i + 1], logits_to_keep=1)[:, -1] for i in range(30, ids.shape[1])]
    frames = [layer.tier.frames.frame_page.clone() for layer in cache.layers]
    return torch.stack(logits), frames, [int(layer.tier.frames.copied.sum()) for layer in cache.layers], cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cold_dtype,batch", [("auto", 1), ("model", 2)])
def test_a_recall_cache_is_the_same_with_the_kernels(without_kernel, cold_dtype, batch, dtype):
    """A bf16 or fp32 llama's two-tier cache (the exact selector over int8-value cold pages, as by default, or
    the model's) through a chunk and 40 decode steps: the same logits, the same pages in the frames and the same
    copies as without the kernels (the decode steps' choice in one call, ``native_choice.DecodeChoice``)."""
    model = build_model("llama", seed=3, max_position_embeddings=256).to(dtype)
    ids = torch.randint(3, VOCAB, (batch, 70), generator=torch.Generator().manual_seed(3))
    got = _run_recall_cache(model, ids, cold_dtype)
    without_kernel()
    want = _run_recall_cache(model, ids, cold_dtype)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1])) and got[2] == want[2] and sum(got[2]) > 0


def test_an_fp32_models_bf16_cold_keys_take_the_c_route(monkeypatch):
    """auto's store for an fp32 model keeps bf16 keys, and its prompt chunk and decode steps choose in the
    one C call (the queries rounded to bf16), never by the torch routes."""
    from h2ochat.recall import tier as tier_module

    def refused(*args, **kwargs):
        raise AssertionError("the torch route ran")

    monkeypatch.setattr(tier_module, "fill_recall_slots", refused)
    model = build_model("llama", seed=3, max_position_embeddings=256)
    ids = torch.randint(3, VOCAB, (1, 70), generator=torch.Generator().manual_seed(3))
    _, _, copies, cache = _run_recall_cache(model, ids)
    assert sum(copies) > 0 and all(layer.tier.cold.keys.dtype == torch.bfloat16 for layer in cache.layers)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (6, 2, 40), (4, 1, 16)])
def test_decode_choices_of_other_groups_are_the_torch_routes(without_kernel, monkeypatch, heads, kv_heads, head_dim,
                                                              dtype):
    """The decode steps' one-call choice (``native_choice.DecodeChoice``) for groups of 1, 3 and 4 query heads and
    head dims 64, 40 (a tail of 8 channels) and 16 (only a tail): the same logits, frames and copies as the
    torch route."""
    model = build_model("llama", seed=3, max_position_embeddings=256, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim).to(dtype)
    ids = torch.randint(3, VOCAB, (2, 70), generator=torch.Generator().manual_seed(4))
    chosen = set()  # (queries, head dim) of each choice the C kernel made
    call = native_choice.DecodeChoice.__call__

    def spied(self, queries, scored, rows=True, rest=None):
        taken = call(self, queries, scored, rows, rest)
        if taken and self.cold.count.any():
            chosen.add(tuple(queries.shape[2:]))
        return taken

    monkeypatch.setattr(native_choice.DecodeChoice, "__call__", spied)
    got = _run_recall_cache(model, ids)
    assert (heads // kv_heads, head_dim) in chosen
    without_kernel()
    want = _run_recall_cache(model, ids)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1])) and got[2] == want[2] and sum(got[2]) > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_chunks_choose_as_without_the_kernels(monkeypatch, dtype):
    """Prompt chunks read into a bf16 recall cache whose store already holds pages (a chunk's choice: the
    group's 2 query heads times 30 tokens in one C call, ``native_choice.DecodeChoice``), then decode steps: the
    same logits, frames and copies as with ``H2OCHAT_CPU_KERNELS=none`` (the torch routes only)."""
    model = build_model("llama", seed=5, max_position_embeddings=256).to(dtype)
    ids = torch.randint(3, VOCAB, (2, 100), generator=torch.Generator().manual_seed(5))
    chosen = []  # (queries, whether the store held a page) of each choice the C kernel made
    call = native_choice.DecodeChoice.__call__

    def spied(self, queries, scored, rows=True, rest=None):
        taken = call(self, queries, scored, rows, rest)
        if taken:
            chosen.append((queries.shape[2], bool(self.cold.count.any())))
        return taken

    def run():
        cache = recall_cache(model.config.num_hidden_layers, "h2o", 12, recall=RecallConfig(16, 4, "exact"),
                             max_positions=max_positions(model.config), positions="absolute",
                             rotary=find_rotary(model))
        use_h2o_attention(model)
        logits = [forward(model, cache, ids[:, start:start + 30], logits_to_keep=1)[:, -1] for start in (0, 30, 60)]
        logits += [forward(model, cache, ids[:, i:i + 1], logits_to_keep=1)[:, -1] for i in range(90, 100)]
        return (torch.stack(logits), [layer.tier.frames.frame_page.clone() for layer in cache.layers],
                [int(layer.tier.frames.copied.sum()) for layer in cache.layers])

    monkeypatch.setattr(native_choice.DecodeChoice, "__call__", spied)
    got = run()
    assert (60, True) in chosen
    monkeypatch.setattr(native_choice.DecodeChoice, "__call__", call)
    monkeypatch.setenv(dispatch.CPU_SWITCH, "none")
    assert not native.available()
    want = run()
    assert torch.equal(got[0], want[0]) and got[2] == want[2] and sum(got[2]) > 0
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_the_frames_plan_is_the_torch_routes(without_kernel):
    """60 updates of random wanted pages (some -1, some already held), pages still filling: the same
    plans and the same frame state."""
    from h2ochat.recall.step import RecallFrames

    def run():
        generator = torch.Generator().manual_seed(11)
        frames, plans = RecallFrames(2, 3, 5), []
        for step in range(60):
            wanted = torch.randperm(12, generator=generator)[:4].expand(2, 3, 4).clone()
            wanted[torch.rand(2, 3, 4, generator=generator) < 0.2] = -1
            complete = torch.full((2, 3), step // 6, dtype=torch.long) if step % 3 else None
            plan = frames.update(wanted, complete)
            plans.append((plan.frame_page, plan.load))
        return plans, frames.state_tensors()

    got = run()
    without_kernel()
    want = run()
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got[0], want[0]))
    assert all(torch.equal(got[1][name], want[1][name]) for name in want[1])


@pytest.mark.parametrize("cold_dtype,limit,dtype,kv_dtype", [
    ("int8-values", None, torch.bfloat16, "auto"), ("model", 24, torch.bfloat16, "auto"),
    ("int8-values", 16, torch.float32, "auto"), ("int8-values", None, torch.bfloat16, "int8"),
    ("model", 24, torch.bfloat16, "int8"), ("int8-values", 16, torch.float32, "int8"),
    ("bf16-keys", None, torch.float32, "auto"), ("bf16-keys", 16, torch.float32, "int8")])
def test_filling_the_frames_is_the_torch_routes(without_kernel, cold_dtype, limit, dtype, kv_dtype):
    """A store (a ring under a limit, int8 values or the model's) holding a part page, a plan loading
    held pages, dropped ones, the part page and -1 into views of bigger slot buffers: the same slots. Int8
    slots: the same codes, scales and offsets as the torch route's ``slot_format.encode`` (keys and values of
    other widths, and a key whose codes fall half-way between two levels: ties to even)."""
    from h2ochat.kv.slot_format import slot_format
    from h2ochat.recall.cold_store import ColdStore
    from h2ochat.recall.step import RecallPlan, RecallSlots, fill_recall_slots

    generator = torch.Generator().manual_seed(5)
    store = ColdStore(2, 3, 16, 20, 4, dtype, cold_dtype=cold_dtype, limit=limit)
    tokens = 37
    index = torch.arange(tokens).expand(2, 3, tokens)
    keys = torch.randn(2, 3, tokens, 16, generator=generator)
    keys[0, 0, 1] = torch.tensor([0.0, 255.0, 1.5, 2.5, 3.5, 100.5, -0.0, 7.5] * 2)  # int8: scale 1, ties
    store.append(keys.to(dtype), torch.randn(2, 3, tokens, 20, generator=generator).to(dtype), index, index + 100)
    frame_page = torch.tensor([0, 9, 8, -1, 2]).expand(2, 3, 5).clone()
    load = torch.rand(2, 3, 5, generator=generator) < 0.7
    load[0, 0, 0] = True
    layout = slot_format(kv_dtype, 16, 20, dtype)

    def filled():
        layer = {name: tensor.fill_(7) for name, tensor in layout.allocate((2, 3, 30), "cpu").items()}
        layer.update({"token_index": torch.full((2, 3, 30), 5), "positions": torch.full((2, 3, 30), 5)})
        views = {name: tensor[:, :, 8:28] for name, tensor in layer.items()}
        fill_recall_slots(RecallSlots.of(views, layout), store, RecallPlan(frame_page, load), None, layout)
        return layer

    got = filled()
    without_kernel()
    want = filled()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("cold_dtype,dtype", [("int8-values", torch.bfloat16), ("int8-values", torch.float32),
                                              ("model", torch.bfloat16), ("bf16-keys", torch.float32)])
def test_appending_to_the_store_is_the_torch_routes(without_kernel, cold_dtype, dtype):
    """Two appends of views of bigger buffers (a flush's staging page), entries with token index -1 among
    them, one head appending nothing: the same buffers, counts and slots."""
    from h2ochat.recall.cold_store import ColdStore

    generator = torch.Generator().manual_seed(9)
    batches = []
    for _ in range(2):
        keys = (torch.randn(2, 3, 12, 16, generator=generator) * 3).to(dtype)[:, :, 2:10]
        values = (torch.randn(2, 3, 12, 20, generator=generator) * 3).to(dtype)[:, :, 2:10]
        index = torch.randint(0, 500, (2, 3, 12), generator=generator)[:, :, 2:10]
        index = index.masked_fill(torch.rand(2, 3, 8, generator=generator) < 0.3, -1)
        index[1, 2] = -1
        batches.append((keys, values, index, index + 7))
    ties = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 1.5, 0.5, -127.0])  # x / scale half-way: rounded to even
    batches[0][1][0, 0, 0] = torch.cat([ties, torch.zeros(12)]).to(dtype)
    batches[0][2][0, 0, 0] = 3

    def stored():
        store = ColdStore(2, 3, 16, 20, 4, dtype, cold_dtype=cold_dtype)
        store.reserve(16)
        slots = [store.append(*batch, reserve=False) for batch in batches]
        return slots, store.state_tensors()

    got = stored()
    without_kernel()
    want = stored()
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    for name, tensor in want[1].items():
        held = (slice(None), slice(None), slice(0, -1)) if tensor.dim() >= 3 else ()  # (not the spill slot: never read)
        assert torch.equal(got[1][name][held], tensor[held]), name
