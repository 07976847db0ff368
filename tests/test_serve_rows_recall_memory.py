"""Recall does not cost a server its rows: --kv-memory counts the rows' device KV (their slots) with recall or
without, and recall's cold stores have a bound of their own (--recall-memory), grow by pages with the tokens
evicted, and at the bound keep no more (the tokens are dropped and counted, as without recall)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import VOCAB, build_model
from serve_fakes import make_request, model_engine

from h2ochat.host_buffers import resident_bytes
from h2ochat.recall.cold_bound import ColdBound, append_bytes
from h2ochat.recall.cold_store import ColdStore
from h2ochat.serve.server import ServeConfig, choose_recall_memory, choose_rows

BUDGET, CHUNK = "16", 5
RECALL = dict(recall="8", page=4)


def backend(model, rows=1, cache=None, **kwargs):
    return model_engine(model, rows, budget=BUDGET, chunk=CHUNK, cache=cache, **kwargs)[0].backend


def test_the_same_kv_memory_holds_the_same_rows_with_recall_or_without(family):
    """The row count divides --kv-memory by the rows' device KV: recall's columns are slots of the budget,
    so a row costs the same, and the cold store (host memory, bounded apart) is not counted."""
    model = build_model(family)
    with_recall, without = backend(model, cache=RECALL).row_bytes(), backend(model, cache=dict(recall="0")).row_bytes()
    assert with_recall == without
    for rows in (1, 5, 26):
        config = ServeConfig(model="x", settings=None, kv_memory=rows * without + without // 2)
        assert choose_rows(config, with_recall, "cpu")[0] == choose_rows(config, without, "cpu")[0] == rows
        assert "recall" not in choose_rows(config, with_recall, "cpu")[1]


def test_the_recall_memory_is_given_or_half_the_free_host_memory_up_to_the_default(monkeypatch):
    from h2ochat.serve import server

    given = ServeConfig(model="x", settings=None, recall_memory=300 << 20)
    assert choose_recall_memory(given, 0) == (300 << 20, "--recall-memory 300.00 MiB")
    monkeypatch.setattr(server, "available_memory", lambda device: 64 << 30)
    bound, said = choose_recall_memory(ServeConfig(model="x", settings=None), 1 << 30)
    assert bound == server.DEFAULT_RECALL_MEMORY and "--recall-memory for more" in said
    monkeypatch.setattr(server, "available_memory", lambda device: 3 << 30)
    bound, said = choose_recall_memory(ServeConfig(model="x", settings=None), 1 << 30)  # (the rows' KV: host memory)
    assert bound == 1 << 30 and said.startswith("half the host memory free beside the rows")


def _append(store: ColdStore, row: int, tokens: int, start: int = 0) -> None:
    """``tokens`` evicted tokens of ``row`` (the other rows evict nothing), room made as they come."""
    batch, heads = store.count.shape
    generator = torch.Generator().manual_seed(row * 1000 + start)
    keys = torch.randn(batch, heads, tokens, store.keys.shape[-1], generator=generator)
    values = torch.randn(batch, heads, tokens, store.values.shape[-1], generator=generator)
    index = torch.full((batch, heads, tokens), -1, dtype=torch.long)
    index[row] = torch.arange(start, start + tokens)
    store.append(keys, values, index, index.clone())


@pytest.mark.parametrize("limit", [None, 8192], ids=["growing", "ring"])
def test_a_cold_stores_memory_follows_the_tokens_written_not_the_window(limit):
    """Resident pages (``mincore``) after a few hundred evicted tokens of one row of eight: a small part of
    what the full window's reservation took (a ring's frames were filled whole when made)."""
    batch, heads, dim, window = 8, 3, 64, 8192
    store = ColdStore(batch, heads, dim, dim, 8, torch.float32, cold_dtype="bf16-keys", limit=limit)
    _append(store, 0, 300)
    _append(store, 0, 200, start=300)
    values = store.values  # (int8 codes: the ones that follow a row's tokens; resident_bytes reads no page)
    per_token = heads * (dim * 2 + dim + 4)  # bf16 key, int8 value and its scale, per token of a row
    full_window = batch * window * per_token
    follows = resident_bytes(store.keys) + resident_bytes(values) + resident_bytes(store.value_scale)
    assert follows <= 500 * per_token + 3 * batch * heads * 2 * 4096  # (each (row, head) block ends in a partial page)
    assert follows < full_window / 20
    assert store.written_nbytes() < store.nbytes() or limit is None


def test_appends_stop_at_the_bound_the_longest_rows_first_and_count_what_they_drop():
    batch, heads, dim = 3, 2, 16
    store = ColdStore(batch, heads, dim, dim, 4, torch.float32, cold_dtype="model")
    bound = ColdBound(1 << 20)
    store.bounded_by(bound)
    per_token = heads * (2 * dim * 4)
    added = torch.zeros(batch, heads, dtype=torch.long)
    added[:] = 10
    growth, rows = append_bytes(store, added, 10)  # (figures only: nothing written)
    assert rows == [10 * per_token] * batch and bound.in_use == store.written_nbytes()
    assert growth > 0  # (ten tokens pass the first page: the store grows)
    _append(store, 0, 40)
    _append(store, 1, 8)
    assert bound.in_use == store.written_nbytes()
    # room for one row's ten tokens and the growth: the shortest rows are admitted first
    room_for = bound.in_use + growth + 10 * per_token + per_token // 2
    tight = ColdBound(room_for)
    store.bounded_by(tight)
    assert tight.admitted(store, growth, dict(enumerate(rows)), {0: 40, 1: 8, 2: 0}) == [2]
    full = ColdBound(store.written_nbytes())  # (a bound the store fills: nothing more)
    full.note(store)
    assert full.admitted(store, 0, {2: per_token}, {2: 0}) == [] and full.admitted(store, 0, {2: 0}, {2: 0}) == [2]


def recall_engine(model, rows, limit):
    bound = ColdBound(limit)
    scheduler = model_engine(model, rows, budget=BUDGET, chunk=CHUNK, cache=RECALL, buckets=(rows,),
                             cold_bound=bound)[0]
    return scheduler, bound


def test_a_long_load_holds_the_bound_drops_what_passes_it_and_generates_on(family, seed):
    """Three long chats on a third of the bytes they evict: no append takes the stores' written bytes past the
    bound (a chat installed from the cache its prompt was read into is copied whole, and a prompt's new cache
    takes its first page: the moves that may), the
    evicted tokens past it are dropped and counted, and every chat generates all its tokens."""
    rng = random.Random(seed)
    model = build_model(family)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(20, 30))] for _ in range(3)]
    free, unbounded = recall_engine(model, 3, 1 << 40)
    assert [len(request.choices[0].generated) for request in _serve(free, prompts, 40)] == [40] * 3
    assert unbounded.dropped_tokens == 0
    limit = unbounded.peak // 3
    scheduler, bound = recall_engine(model, 3, limit)
    batch = scheduler.backend.cache
    moves, installing = [], []
    noted, imported = bound.note, batch.import_row

    def note(store):  # every change of the stores' bytes: (before, after, whether it came from no append)
        before = bound.in_use
        noted(store)
        made = not bool(store.count.any())  # (a prompt's new cache: its empty first page)
        moves.append((before, bound.in_use, bool(installing) or made))

    def import_row(*args, **kwargs):
        installing.append(True)
        try:
            return imported(*args, **kwargs)
        finally:
            installing.pop()

    bound.note, batch.import_row = note, import_row
    requests = _serve(scheduler, prompts, 40)
    appends = [(before, after) for before, after, copied in moves if not copied]
    assert all(after <= max(limit, before) for before, after in appends)
    assert max(after for _, after, _ in moves) > limit // 2  # (the bound was used)
    assert bound.dropped_tokens > 0
    assert scheduler.backend.cache.tier_stats().dropped_tokens > 0  # (the batch's stores count theirs too)
    assert [len(request.choices[0].generated) for request in requests] == [40] * 3


def _serve(scheduler, prompts, tokens):
    requests = [make_request(ids, max_tokens=tokens, stop_ids=()) for ids in prompts]
    for request in requests:
        scheduler.submit(request)
    for _ in range(3000):
        if scheduler.idle:
            break
        scheduler.step()
    assert scheduler.idle
    return requests


@pytest.mark.parametrize("given, said", [
    ("0", "--recall-memory 0 keeps no evicted token"),
    ("0GiB", "--recall-memory 0GiB keeps no evicted token"),
    ("lots", "--recall-memory must be a size like 2GiB"),
])
def test_a_bad_recall_memory_is_one_line_and_a_failure(h2ochat_main, given, said):
    result = h2ochat_main("serve", "--random-weights", "--recall-memory", given, "--port", "0")
    code, err = result.returncode, result.stderr
    assert code != 0 and said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_start_up_and_metrics_state_the_bound_the_bytes_in_use_and_the_drops(family):
    from h2ochat.serve.server import recall_memory_line

    said = recall_memory_line(4 << 30, "the default 4.00 GiB; --recall-memory for more")
    assert "up to 4.00 GiB for the recall tier's cold stores (the default" in said and "dropped" in said
    assert recall_memory_line(None, "") == ""
    model = build_model(family)
    bound = ColdBound(1 << 20)
    gauges = backend(model, cache=RECALL, cold_bound=bound).tier_gauges()
    assert gauges["recall_memory_bound_bytes"][1] == 1 << 20
    assert gauges["recall_memory_bytes_in_use"][1] == bound.in_use > 0  # (the stores' first pages)
    assert gauges["recall_dropped_tokens"][1] == 0
    assert "recall_memory_bound_bytes" not in backend(model, cache=RECALL).tier_gauges()
