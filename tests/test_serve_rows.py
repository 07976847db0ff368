"""The rows a serve decode step runs, on real tiny models: only the smallest bucket (1, 2, 4, ... N)
that holds the rows in use, kept at the front by moving rows down; free rows left out of the step by
the cache's ``active`` mask (they write nothing); a cache that cannot leave rows out runs them all.

References are exact: a step of R rows rounds the last bit as any other step of R rows does, so a
request alone on an 8-row server is compared with the same request on a 1-row server, and a workload
that never holds more than two rows on an 8-row server with the same workload on a 2-row server."""

from __future__ import annotations

import random

import pytest
import torch

from h2ochat.kv import H2OCache
from h2ochat.serve.rows import bucket_sizes

from conftest import VOCAB, build_model
from serve_fakes import drain, generated, make_request, model_engine

CHUNK = 5


def engine(model, rows, budget="12", **kwargs):
    return model_engine(model, rows, budget=budget, chunk=CHUNK, store_bytes=1 << 26, **kwargs)


def prompt(rng, low=1, high=20):
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))]


def parked_states(backend):
    """Every parked conversation's state, copied out or resting in its row (``RowPool.parked_state``)."""
    return {key: backend.pool.parked_state(entry) for key, entry in backend.store._entries.items()}


def same_state(a, b) -> bool:
    return all(torch.equal(x[name], y[name]) for x, y in zip(a.layers, b.layers) for name in x) and all(
        torch.equal(a.counters[name], b.counters[name]) for name in a.counters)


def test_bucket_sizes():
    assert bucket_sizes(1) == [1] and bucket_sizes(2) == [1, 2] and bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(17) == [1, 2, 4, 8, 16, 17] and bucket_sizes(64)[-2:] == [32, 64]


# the caches a server's rows run in buckets: plain h2o, and recall (its buckets step the batch's tiers,
# ``TierSpec.row_prefixes``; a row moved down keeps its staging page and clock, ``H2OCache.move_row``)
KINDS = {"h2o": {}, "recall": dict(budget="16", cache=dict(recall="8", page=4))}


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_request_on_a_large_server_runs_one_row_as_a_1_row_server_does(family, seed, kind):
    """Past the model's 64 positions too: the re-numbering happens in the 1-row step's cache."""
    rng = random.Random(seed)
    model = build_model(family)
    first = prompt(rng)
    plan = [(first, 80), (first[:3] + [7], rng.randint(1, 9))]  # the second does not extend the first
    runs = []
    for rows in (8, 1):
        scheduler, store = engine(model, rows, **KINDS[kind])
        requests = [make_request(ids, max_tokens=tokens, stop_ids=()) for ids, tokens in plan]
        for request in requests:  # one after the other
            scheduler.submit(request)
            drain(scheduler)
        runs.append(([generated(request) for request in requests], parked_states(scheduler.backend), scheduler.backend))
    (large, large_parked, backend), (small, small_parked, _) = runs
    assert large == small
    assert large_parked.keys() == small_parked.keys()
    assert all(same_state(large_parked[key], small_parked[key]) for key in large_parked)
    assert set(backend.steps_by_rows) == {1}
    assert backend.cache.compactions > 0  # the re-numbering ran in the 1-row cache and reached the batch cache


@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_in_use_are_moved_to_the_front_and_the_server_size_changes_no_token(family, seed, kind):
    """A workload that never holds more than two rows, on an 8-row and on a 2-row server: the same
    steps of the same rows (a finished row below a running one is filled by moving it down), so the
    same tokens, bit for bit."""
    rng = random.Random(seed)
    model = build_model(family)
    # (prompt, tokens, steps before it comes): the first two run together and the first ends first
    # (its row is then filled by the second), the others come at random; the third is more than one
    # chunk (a prompt read in the step the first row frees would take that row, and nothing moves)
    plan = [(prompt(rng), rng.randint(10, 15), 0), (prompt(rng), rng.randint(40, 70), 0)]
    plan += [(prompt(rng, CHUNK + 1, 20) if number == 0 else prompt(rng), rng.randint(2, 70), rng.randint(0, 8))
             for number in range(4)]
    runs = []
    for rows in (8, 2):
        scheduler, _ = engine(model, rows, **KINDS[kind])
        moves = []
        backend_move = scheduler.backend.move
        scheduler.backend.move = lambda source, target: (moves.append((source, target)), backend_move(source, target))
        requests = []
        for ids, tokens, wait in plan:
            for _ in range(wait):
                scheduler.step()
            while scheduler.rows_in_use + len(scheduler.waiting) + (scheduler.admitting is not None) >= 2:
                scheduler.step()
            requests.append(make_request(ids, max_tokens=tokens, stop_ids=()))
            scheduler.submit(requests[-1])
        drain(scheduler)
        runs.append(([generated(request) for request in requests], moves, scheduler.backend))
    (large, large_moves, backend), (small, small_moves, _) = runs
    assert large == small and large_moves == small_moves
    assert set(backend.steps_by_rows) == {1, 2} and (1, 0) in large_moves


def test_free_rows_write_nothing(family, seed):
    """Every step runs all 4 rows (one bucket): the rows nobody uses stay empty, as if never stepped."""
    rng = random.Random(seed)
    scheduler, _ = engine(build_model(family), 4, buckets=(4,))
    request = make_request(prompt(rng), max_tokens=30, stop_ids=())
    scheduler.submit(request)
    for _ in range(20):
        scheduler.step()
    cache = scheduler.backend.cache
    row = request.choices[0].row
    free = [r for r in range(4) if r != row]
    assert scheduler.backend.steps_by_rows[4] > 10
    for layer in cache.layers:
        assert bool((layer.token_index[free] == -1).all()) and bool((layer.keys[free] == 0).all())
        assert int(layer.evicted[free].sum()) == 0 and bool((layer.scores[free] == 0).all())
    assert int(cache.tokens_fed[free].sum()) == 0 and int(cache.next_position[free].sum()) == 0
    assert int(cache.tokens_fed[row]) > 20


def test_a_cache_that_cannot_leave_rows_out_feeds_every_row_the_same_tokens(monkeypatch, seed):
    """A cache whose layers cannot mask rows (a recall tier) runs all N rows, free ones on a
    placeholder token reset before their positions reach the model's limit: the same tokens as the
    masked step of all N rows."""
    rng = random.Random(seed)
    model = build_model("llama")
    plan = [(prompt(rng), rng.randint(20, 60)) for _ in range(4)]
    runs = []
    for masks in (True, False):
        if not masks:
            monkeypatch.setattr(H2OCache, "masks_inactive_rows", property(lambda self: False))
        scheduler, _ = engine(model, 3, buckets=(3,))
        assert scheduler.backend.masks_rows is masks and scheduler.backend.buckets == [3]
        requests = [make_request(ids, max_tokens=tokens, stop_ids=()) for ids, tokens in plan]
        for request in requests:
            scheduler.submit(request)
        drain(scheduler)
        runs.append([generated(request) for request in requests])
    assert runs[0] == runs[1]
