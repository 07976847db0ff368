"""A decode step that leaves some rows out (``active`` mask): the rows left out write nothing, the
others step exactly as without the mask. On every route: the torch rules, the Triton kernels
(interpreter) and the compiled step (aot_eager), for every policy kind (decay, value norms, per-layer
budgets, a rank of its own), a cache still filling (append) and a full one (eviction)."""

from __future__ import annotations

import pytest
import torch

from h2ochat.engine.compiled import CompiledDecode
from h2ochat.engine.forward_step import EagerDecode
from h2ochat.engine.generation import CacheSettings, Sampling, Timing, prefill, stream

from conftest import FAMILIES, build_model, random_ids, triton_interpreter_ready

POLICIES = ["h2o", "decay:decay=0.7", "mean:value_eps=0.1", "tova", "sink", "h2o:layer_shape=0.5", "random"]
BATCH, PROMPT = 3, 10
LEFT_OUT = 1  # the row that sits the masked step out


def snapshot(cache) -> dict[str, torch.Tensor]:
    """Every tensor the cache holds for its rows: the layers' state and the per-row counters."""
    state = {f"{index}.{name}": t.clone() for index, layer in enumerate(cache.layers)
             for name, t in layer.state_tensors().items()}
    state["tokens_fed"], state["next_position"] = cache.tokens_fed.clone(), cache.next_position.clone()
    return state


def assert_rows_equal(got: dict, want: dict, rows, message: str) -> None:
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name][rows], want[name][rows]), f"{message}: {name} differs"


def prefilled_pair(model, policy: str, budget: str, seed: int, allocate=None, **build):
    """Two caches fed the same prompt (the same numbers: the same deterministic steps).
    ``allocate(cache)`` allocates the slots first (the eviction route is chosen then)."""
    ids = random_ids(BATCH, PROMPT, torch.Generator().manual_seed(seed))
    caches = []
    for _ in range(2):
        cache = CacheSettings(policy=policy, budget=budget, seed=seed).build(model, **build)
        if allocate is not None:
            allocate(cache)
        prefill(model, cache, ids, chunk=4)
        caches.append(cache)
    return caches


def check_masked_step(model, policy, budget, seed, decode_with, allocate=None, steps=3, **build) -> None:
    masked, plain = prefilled_pair(model, policy, budget, seed, allocate, **build)
    tokens = random_ids(BATCH, 1, torch.Generator().manual_seed(seed + 1))[:, 0]
    active = torch.ones(BATCH, dtype=torch.bool)
    active[LEFT_OUT] = False
    before = snapshot(masked)
    for step in range(steps):  # the left-out row sits out every step; the others go on as without a mask
        decode_with(masked, tokens, active)
        decode_with(plain, tokens, None)
        message = f"{policy} budget {budget} step {step}"
        assert_rows_equal(snapshot(masked), before, [LEFT_OUT], message + " (row left out)")
        kept = [row for row in range(BATCH) if row != LEFT_OUT]
        assert_rows_equal(snapshot(masked), snapshot(plain), kept, message + " (active rows)")
        tokens = (tokens * 7 + 5) % 90 + 3
    # host counters advance as upper bounds; restore puts back exact ones when no row was fed
    saved = masked.host_counters()
    decode_with(masked, tokens, torch.zeros(BATCH, dtype=torch.bool))
    masked.restore_host_counters(saved)
    assert masked.host_counters() == saved


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("budget", ["6", "16"], ids=["evicting", "filling"])
def test_torch_route_left_out_rows_write_nothing(family, policy, budget, seed, monkeypatch):
    monkeypatch.setenv("H2OCHAT_KERNELS", "torch")
    model = build_model(family, seed=seed)
    check_masked_step(model, policy, budget, seed, EagerDecode(model))


@pytest.mark.parametrize("policy", POLICIES)
def test_torch_route_static_shapes(policy, seed, monkeypatch):
    """Static shapes (what the compiled step runs eagerly): a cache still filling evicts in place too."""
    monkeypatch.setenv("H2OCHAT_KERNELS", "torch")
    model = build_model("llama", seed=seed)
    check_masked_step(model, policy, "16", seed, EagerDecode(model), static_shapes=True)


@pytest.mark.skipif(not triton_interpreter_ready(), reason="needs the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("policy", ["decay:decay=0.7", "mean:value_eps=0.1", "sink", "h2o:layer_shape=0.5", "random"])
def test_triton_route_left_out_rows_write_nothing(policy, seed, monkeypatch):
    """The kernels' routes (the fused eviction by score with decay, by age and value norm, by token
    index; a priority given: random; the decode attention with its score decay). The slots are
    allocated with the Triton eviction chosen; the prompt goes through torch (the interpreter is slow)."""
    model = build_model("llama", seed=seed)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads

    def allocate(cache):
        monkeypatch.setenv("H2OCHAT_KERNELS", "triton")
        cache.allocate(BATCH, config.num_key_value_heads, head_dim, dtype=torch.float32, device="cpu")
        assert cache.layers[0].kernels.triton
        monkeypatch.setenv("H2OCHAT_KERNELS", "torch")

    def decode(cache, tokens, active):
        monkeypatch.setenv("H2OCHAT_KERNELS", "triton")
        return EagerDecode(model)(cache, tokens, active)

    check_masked_step(model, policy, "6", seed, decode, allocate, steps=1, static_shapes=True)


@pytest.mark.parametrize("family_name,policy", [*((name, "h2o") for name in FAMILIES),
                                                ("llama", "decay:decay=0.7"), ("llama", "mean:value_eps=0.1")])
def test_compiled_step_with_a_mask_matches_eager(family_name, policy, seed, monkeypatch):
    """aot_eager: the mask is a graph input; the compiled masked step equals the eager one bit for bit
    (the same ops), and a step given no mask runs the same graph (all rows active)."""
    monkeypatch.setenv("H2OCHAT_KERNELS", "torch")
    torch._dynamo.reset()
    model = build_model(family_name, seed=seed)
    compiled = CompiledDecode(model, backend="aot_eager")
    eager_cache, compiled_cache = prefilled_pair(model, policy, "6", seed, static_shapes=True)
    eager = EagerDecode(model)
    tokens = random_ids(BATCH, 1, torch.Generator().manual_seed(seed + 1))[:, 0]
    masks = [torch.tensor([True, False, True]), None, torch.tensor([False, True, False])]
    for active in masks:
        want = eager(eager_cache, tokens, active)
        got = compiled(compiled_cache, tokens, active)
        rows = active if active is not None else torch.ones(BATCH, dtype=torch.bool)
        assert torch.allclose(got[rows], want[rows], atol=1e-5)
        assert_rows_equal(snapshot(compiled_cache), snapshot(eager_cache), slice(None), f"{policy} mask {active}")
        tokens = (tokens * 7 + 5) % 90 + 3


# -- stream: bursts of decode steps, finished rows left out --------------------------------------------

def run_stream(model, ids, stops, every, seed, policy="h2o"):
    cache = CacheSettings(policy=policy, budget="8").build(model)
    timing = Timing()
    steps = [step.tokens.clone() for step in stream(model, cache, ids, max_new_tokens=14, stop_ids=stops,
                                                    sampling=Sampling(temperature=1.0, seed=seed),
                                                    stop_check_every=every, timing=timing)]
    return torch.stack(steps), cache, timing


def mid_burst_stop(row: list[int]) -> int:
    """The token of ``row`` whose first appearance is latest among those not at a burst's last step
    (nor the last step of all, which ends the generation anyway)."""
    firsts = {token: row.index(token) for token in row}
    return max(firsts, key=lambda token: (firsts[token] % 4 != 3 and firsts[token] < len(row) - 1, firsts[token]))


def finish_index(tokens: torch.Tensor, stops: set[int]) -> list[int | None]:
    """Per row, the step at which it drew its first stop id (None: never)."""
    hits = [[i for i, t in enumerate(row) if t in stops] for row in tokens.t().tolist()]
    return [h[0] if h else None for h in hits]


@pytest.mark.parametrize("family_name", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_stream_in_bursts_leaves_the_cache_as_one_step_at_a_time(family_name, batch, seed):
    """k = 4 with stop ids drawn mid-burst (rows finishing at different steps): the same tokens as
    k = 1 and the same cache, bit for bit (every layer's state, the per-row and the host counters);
    a finished row's cache holds its prompt and its tokens up to the stop, nothing after."""
    model = build_model(family_name, seed=seed)
    ids = random_ids(batch, 6, torch.Generator().manual_seed(seed))
    free, _, _ = run_stream(model, ids, frozenset(), 1, seed)
    # stop ids drawn inside a burst of 4 (steps queue after them): row 0's, and for a batch row 2's
    stops = {mid_burst_stop(free[:, 0].tolist())} | ({mid_burst_stop(free[:, 2].tolist())} if batch > 1 else set())
    if batch == 1:
        assert finish_index(free, stops)[0] % 4 != 3 and finish_index(free, stops)[0] < len(free) - 1
    one, one_cache, _ = run_stream(model, ids, stops, 1, seed)
    four, four_cache, timing = run_stream(model, ids, stops, 4, seed)
    assert torch.equal(one, four)
    assert timing.fed_past_stop == 0
    assert_rows_equal(snapshot(four_cache), snapshot(one_cache), slice(None), "k=4 against k=1")
    assert four_cache.host_counters() == one_cache.host_counters()
    for row, end in enumerate(finish_index(four, stops)):
        fed = 6 + (end if end is not None else len(four) - 1)  # the stop (or the last) token is never fed
        assert int(four_cache.tokens_fed[row]) == fed, f"row {row} finished at step {end}"
