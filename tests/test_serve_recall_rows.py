"""`serve --recall`: each row's recall is its own (issue 34). A chat served beside others, joining at
other steps, gives the tokens it gives alone (temperature 0), for the three families: the staging
page flushes on the row's own count of decode steps, the ``--recall-every`` cadence counts from the
row's own flush, a row joining folds only its own staged tokens, and free rows sit the step out (they
write, evict and stage nothing). A parked conversation costs host bytes in proportion to its length.
"""

from __future__ import annotations

import random

import pytest

from conftest import VOCAB, build_model
from serve_fakes import drain, generated, make_request, model_engine

BUDGET, CHUNK = "16", 5


def engine(model, rows, every=1, selector="auto", **kwargs):
    """A recall server of ``rows`` rows stepping all of them in every decode step (one bucket, free rows left
    out by the ``active`` mask): a chat alone and beside others then runs the same batch shape, whose sums
    round alike, so its tokens are compared exactly. (Its buckets, each a prefix of its rows sharing its
    tiers, are tests/test_recall_prefix.py's and tests/test_serve_rows.py's.)"""
    kwargs.setdefault("buckets", (rows,))
    return model_engine(model, rows, budget=BUDGET, chunk=CHUNK,
                        cache=dict(recall="8", page=4, recall_every=every, selector=selector), **kwargs)


def prompt(rng, low, high):
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))]


def run(scheduler, arrivals):
    """``arrivals``: (step, prompt, max tokens); each request submitted at its step; the requests."""
    requests, step = [], 0
    pending = sorted(arrivals, key=lambda arrival: arrival[0])
    while pending or not scheduler.idle:
        while pending and pending[0][0] <= step:
            _, ids, tokens = pending.pop(0)
            request = make_request(ids, max_tokens=tokens, stop_ids=())
            scheduler.submit(request)
            requests.append(request)
        scheduler.step()
        step += 1
        assert step < 3000, "the engine did not finish"
    for request in requests:
        assert request.events[-1][0] == "done", request.events[-1]
    return requests


@pytest.mark.parametrize("every", [1, 3])
def test_a_chat_served_beside_others_gives_its_tokens_alone(family, seed, every):
    rng = random.Random(seed)
    model = build_model(family)
    chat = prompt(rng, 22, 27)
    alone = run(engine(model, 4, every)[0], [(0, chat, 26)])[0]
    others = [(0, prompt(rng, 15, 30), 30), (3, prompt(rng, 10, 20), 17), (9, prompt(rng, 20, 25), 9),
              (14, prompt(rng, 5, 12), 22)]
    for joins in (1, 6, 11):  # the chat joins the batch at other steps of the others' pages and cadence
        beside = run(engine(model, 4, every)[0], [*others, (joins, chat, 26)])
        assert generated(beside[-1] if beside[-1].prompt_ids == chat else
                         next(r for r in beside if r.prompt_ids == chat)) == generated(alone), f"joins at {joins}"


def test_a_chat_beside_longer_ones_gives_its_tokens_alone_when_their_summaries_coarsen(family, seed, monkeypatch):
    """With two page summaries per row and head (the cap, and two candidates), the long chats beside it
    coarsen their summaries to 8 pages each and the chat to 2: each row's scale is its own, so the chat
    still gives the tokens it gives alone."""
    from h2ochat.recall import tier
    from h2ochat.recall.two_stage import TwoStageCodes

    seen = set()  # each row's scale after every coarsening, over the run

    class Tight(TwoStageCodes):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "cap": 2, "candidates": 2})

        def _coarsen(self):
            changed = super()._coarsen()
            seen.add(tuple(self._row_pages()))
            return changed

    monkeypatch.setattr(tier, "TwoStageCodes", Tight)
    rng = random.Random(seed)
    model = build_model(family)
    chat = prompt(rng, 18, 20)
    scheduler, _ = engine(model, 4, selector="rot4")  # (the two-stage digest: the default's on a GPU)
    alone = run(scheduler, [(0, chat, 14)])[0]
    # (every row stays inside the tiny models' 64 positions: past them a re-numbering moves positions)
    others = [(0, prompt(rng, 38, 40), 20), (2, prompt(rng, 38, 40), 20)]
    scheduler, _ = engine(model, 4, selector="rot4")
    beside = run(scheduler, [*others, (4, chat, 14)])
    assert any(max(rows) >= 8 and min(rows) < max(rows) for rows in seen), seen  # (rows at different scales)
    assert generated(next(r for r in beside if r.prompt_ids == chat)) == generated(alone)


def test_free_rows_write_nothing_with_recall(family, seed):
    """A free row of a recall server sits decode steps out: its cold store, staging page and
    counters stay empty while another row decodes."""
    rng = random.Random(seed)
    scheduler, _ = engine(build_model(family), 4, store_bytes=0)
    backend = scheduler.backend
    assert backend.masks_rows
    request = make_request(prompt(rng, 20, 30), max_tokens=30, stop_ids=())
    scheduler.submit(request)
    drain(scheduler)
    for layer in backend.cache.layers:
        assert int(layer.tier.cold.count[1:].sum()) == 0
        assert int((layer.token_index[1:] >= 0).sum()) == 0
    assert int(backend.cache.tokens_fed[1:].sum()) == 0


def test_a_decode_steps_choice_of_pages_reads_only_the_rows_in_use(family, seed, monkeypatch):
    """Free rows are skipped with recall too: a decode step's choice of pages scores the rows up to the
    last one in use, not the batch's free rows after it (each row's choice is its own, so the tokens are
    the ones a lone row gives: the test above). One chat on a 4-row server: one row scored."""
    from h2ochat.recall.two_stage import TwoStageCodes

    scored = []
    top_pages = TwoStageCodes.top_pages

    def counted(self, queries, count, upto=None):
        scored.append((queries.shape[0], len(self._row_pages()), self.count.shape[0]))
        return top_pages(self, queries, count, upto)

    monkeypatch.setattr(TwoStageCodes, "top_pages", counted)
    rng = random.Random(seed)
    scheduler, _ = engine(build_model(family), 4, selector="rot4", store_bytes=0)  # (the digest with most row state)
    request = make_request(prompt(rng, 30, 34), max_tokens=24, stop_ids=())
    scheduler.submit(request)
    drain(scheduler)
    decode = [rows for rows in scored if rows != (1, 1, 1)]  # (the prompt's own 1-row cache chooses too)
    assert len(scored) > 20 and not decode, decode  # (before: every decode step scored all 4 rows)


def test_a_parked_conversation_costs_bytes_in_proportion_to_its_length(family, seed):
    rng = random.Random(seed)
    scheduler, store = engine(build_model(family), 2)
    short = make_request(prompt(rng, 20, 20), max_tokens=8, stop_ids=())
    long = make_request(prompt(rng, 38, 38), max_tokens=16, stop_ids=())
    for request in (short, long):
        scheduler.submit(request)
        drain(scheduler)
    entries = sorted(store._entries.values(), key=lambda entry: len(entry.tokens))
    # both rest in their rows: parked, no host bytes of their own yet
    assert [entry.row for entry in entries] == [0, 1] and store.nbytes == 0 and all(not e.nbytes for e in entries)
    for _ in range(2):  # two other chats want both rows: the resting ones are copied out to host memory
        scheduler.submit(make_request(prompt(rng, 6, 6), max_tokens=2, stop_ids=()))
        drain(scheduler)
    assert all(entry.row is None and store.holds(entry) for entry in entries)
    small, large = (entry.state for entry in entries)
    # what grows with the text: the cold store's and the token codes' bytes, over every layer
    def cold(state):
        return sum(tensor.numel() * tensor.element_size() for layer in state.layers
                   for name, tensor in layer.items() if name.startswith(("cold_", "digest_")) and tensor.dim() >= 2
                   and tensor.shape[1] == layer["cold_count"].max())
    def evicted(state):
        return int(state.layers[0]["cold_count"].max())
    page = 4
    assert evicted(large) > 2 * evicted(small) > 0
    # per cold token the bytes are the same (within one page: the stores hold whole pages at most)
    per_token = cold(large) / evicted(large)
    assert abs(cold(small) - per_token * evicted(small)) <= per_token * page
    # the whole entry: a fixed part (the hot slots, the summaries) plus the cold bytes
    fixed = entries[0].nbytes - cold(small)
    assert entries[1].nbytes - fixed == pytest.approx(cold(large), rel=0.01)


def test_the_row_count_counts_the_rows_device_kv_not_the_cold_stores(family):
    """With recall each row is costed its device bytes only (the cold store has its own bound, --recall-memory):
    a budget of three rows gives three rows; the cold store of a conversation of the model's context window is
    what the start-up line says a long row's store grows to."""
    from h2ochat.serve.server import ServeConfig, choose_rows, cold_row_bytes

    model = build_model(family)
    backend = engine(model, 1)[0].backend
    plain = model_engine(model, 1, budget=BUDGET, chunk=CHUNK)[0].backend
    positions = model.config.max_position_embeddings
    cold = cold_row_bytes(backend, positions)
    per_token = backend.cache.tier_host_bytes_per_token()
    assert cold == int(per_token * (positions - backend.slots)) > 0 and cold_row_bytes(plain, positions) == 0
    # what one cold token costs: K in bf16 (an fp32 model's) and V as int8 codes and a scale (the default
    # cold format), its token index, positions and codes
    layers, heads = model.config.num_hidden_layers, backend.kv_heads
    assert per_token >= layers * heads * (backend.head_dim * 2 + backend.head_dim + 4 + 3 * 4)
    row = backend.row_bytes()
    config = ServeConfig(model="x", settings=None, kv_memory=3 * row + cold)
    assert choose_rows(config, row, "cpu")[0] == 3 + cold // row


def test_the_cold_stores_give_back_a_long_rows_room_once_it_is_reset(family, seed):
    """A long chat grows the batch's cold stores; when it ends (its row parked and reset) they shrink to
    what the rows still running hold, and the chat beside it goes on with the same tokens as alone."""
    rng = random.Random(seed)
    model = build_model(family)
    chat = prompt(rng, 10, 12)
    alone = run(engine(model, 2)[0], [(0, chat, 30)])[0]
    scheduler, _ = engine(model, 2)
    long = prompt(rng, 45, 50)
    requests = run(scheduler, [(0, long, 12), (2, chat, 30)])
    assert generated(requests[1]) == generated(alone)
    backend = scheduler.backend
    # both rest in their rows (parked, nothing copied out): the stores keep the long one's room
    assert sorted(backend.pool.resting) == [0, 1]
    long_room = backend.cache.layers[0].tier.cold.capacity
    # another chat wants a row: the long one, resting longest, is copied out and its row emptied, and the
    # stores shrink to what the rows still hold (the chat beside it, and the newcomer now in the long one's row)
    run(scheduler, [(0, prompt(rng, 6, 6), 2)])
    assert backend.pool.resting.keys() == {0, 1} and len(backend.store) == 3 and backend.store.nbytes > 0
    for layer in backend.cache.layers:
        held = int(layer.tier.cold.count.max())
        assert layer.tier.cold.capacity < long_room and layer.tier.cold.capacity <= -(-(held + 4) // 4) * 4
