"""Rows that rest (``serve.rows``): a finished conversation is parked as the free row that ran it, nothing
copied out, and its next turn is read from that row and put back into it. On real tiny models (OPT,
Llama-GQA, GPT-NeoX), with and without a recall tier: a turn resumed from its resting row gives the tokens,
bit for bit, of the same turn resumed from a copy in host memory (its row taken by other chats in between);
rows are taken cheapest first; a resumed prefill that is dropped empties the row it came from.

Every step runs every row (``buckets=(ROWS,)``): a step's numbers are then bitwise the same whatever the
other rows hold, so the two servers' tokens can be compared exactly."""

from __future__ import annotations

import random

import pytest

from conftest import VOCAB, build_model
from serve_fakes import generated, make_request, model_engine, random_prompt, served

ROWS, CHUNK = 2, 5
CACHES = {"h2o": {}, "recall": dict(recall="8", page=4)}


def engine(model, kind):
    return model_engine(model, ROWS, budget="16", chunk=CHUNK, cache=CACHES[kind], buckets=(ROWS,))


def prompt(rng, low=8, high=14):
    return random_prompt(rng, low, high, VOCAB)


def entry_of(store, request):
    """The parked entry of ``request``'s conversation."""
    return next(entry for entry in store._entries.values()
                if list(entry.tokens[: len(request.prompt_ids)]) == list(request.prompt_ids))


@pytest.mark.parametrize("kind", sorted(CACHES))
def test_a_turn_resumed_from_its_resting_row_is_the_turn_resumed_from_host_memory(family, kind, seed):
    rng = random.Random(seed)
    model = build_model(family)
    # the others are longer and pass the tiny models' 64 positions (re-numbered): the prompt's cache that
    # the first chat's next turn is then imported over held more, and moved, tokens than it does
    first, others, more = prompt(rng, 20, 30), [prompt(rng, 50, 60), prompt(rng, 50, 60)], prompt(rng)
    replies = []
    for copied_out in (False, True):
        scheduler, store = engine(model, kind)
        pool = scheduler.backend.pool
        one = served(scheduler, first, 18)
        entry = entry_of(store, one)
        assert entry.row == 0 and pool.resting == {0: entry} and store.nbytes == 0  # (parked as its row)
        if copied_out:  # two other chats: the empty row 1 first, then row 0, where the first chat rests
            for ids in others:
                served(scheduler, ids, 12)
            assert entry.row is None and store.holds(entry) and entry.nbytes > 0  # (copied out when wanted)
        two = served(scheduler, one.prompt_ids + generated(one)[0] + more, 12)
        assert two.cached_tokens == len(first) + 18 - 1
        again = entry_of(store, two)
        if not copied_out:  # read from its row and put back there: nothing ever copied out
            assert again.row == 0 and store.nbytes == 0 and len(store) == 1
        replies.append((generated(two), pool.parked_state(again)))
    (resting, resting_state), (host, host_state) = replies
    assert resting == host
    # and the conversation's state after the turn is the same, bit for bit
    for mine, theirs in zip(resting_state.layers, host_state.layers):
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert mine[name].equal(theirs[name]), name


def test_rows_are_taken_home_first_then_empty_then_resting_longest(family, seed):
    rng = random.Random(seed)
    # (one bucket of the 3 rows: the smallest bucket would come first, before the ranking, ``RowPool.placement``)
    scheduler, store = model_engine(build_model(family), 3, budget="16", chunk=CHUNK, cache=CACHES["recall"],
                                    buckets=(3,))
    pool = scheduler.backend.pool
    a, b, c = (served(scheduler, prompt(rng), 4) for _ in range(3))  # rows 0, 1, 2: the empty rows first
    assert {row: len(entry.tokens) for row, entry in pool.resting.items()} == {
        0: len(a.prompt_ids) + 4, 1: len(b.prompt_ids) + 4, 2: len(c.prompt_ids) + 4}
    d = served(scheduler, prompt(rng), 4)  # every row rests: the one resting longest, a's, is copied out
    assert entry_of(store, a).row is None and entry_of(store, d).row == 0
    # a's next turn: its copy is in host memory, so it takes the row resting longest now (b's)
    a2 = served(scheduler, a.prompt_ids + generated(a)[0] + [5, 6], 3)
    assert a2.cached_tokens > 0 and entry_of(store, a2).row == 1 and entry_of(store, b).row is None
    # c's next turn comes back to its own row, though others have rested longer
    c2 = served(scheduler, c.prompt_ids + generated(c)[0] + [7], 3)
    assert entry_of(store, c2).row == 2 and entry_of(store, d).row == 0
    # (every row rests now, d's longest: a conversation's own row still comes first)
    assert pool.placement([0, 1, 2], 1, home=1) == [1] and pool.placement([0, 1, 2], 2) == [0, 1]


def test_a_resumed_prefill_that_is_cancelled_empties_the_row_it_came_from(family, seed):
    rng = random.Random(seed)
    scheduler, store = engine(build_model(family), "recall")
    backend = scheduler.backend
    one = served(scheduler, prompt(rng, 20, 24), 10)
    assert backend.pool.resting.keys() == {0}
    two = make_request(one.prompt_ids + generated(one)[0] + prompt(rng, 12, 14), max_tokens=4, stop_ids=())
    scheduler.submit(two)
    scheduler.step()  # admitted: its copy read from row 0, the first chunk of its new tokens read
    assert scheduler.job is not None and backend.pool.homes == {0} and len(store) == 0
    scheduler.cancel(two)
    assert not backend.pool.homes and not backend.pool.resting
    assert int(backend.cache.tokens_fed[0]) == 0  # (emptied: the conversation went with its prefill)
    assert scheduler.idle


def test_an_import_into_a_used_1_row_cache_leaves_it_as_a_cache_made_for_the_row(family, seed):
    """The next resumed prompt is imported over the last prompt's 1-row cache (``RowPool.prefill_cache``):
    its state, host counters and the tier's flags are then those of a cache made for it, whatever the
    cache held before (here a longer conversation, which fills more slots and is fed further)."""
    rng = random.Random(seed)
    scheduler, store = engine(build_model(family), "recall")
    backend = scheduler.backend
    short, long = served(scheduler, prompt(rng, 12, 14), 6), served(scheduler, prompt(rng, 60, 62), 12)
    state_of = {name: backend.pool.parked_state(entry_of(store, request))
                for name, request in (("short", short), ("long", long))}
    made = backend._new_cache(1, static_shapes=False)
    made.import_row(0, state_of["short"])
    used = backend._new_cache(1, static_shapes=False)
    used.import_row(0, state_of["long"])
    def host(cache):
        return (cache.largest_next_position, [(layer.host_counters(), layer.tier.cold.moved, layer.tier.has_query)
                                              for layer in cache.layers])
    assert host(used) != host(made)  # (what a merge with the long one's would keep)
    used.import_row(0, state_of["short"])
    assert host(used) == host(made)
    for mine, theirs in zip(used.export_row(0).layers, made.export_row(0).layers):
        assert all(mine[name].equal(theirs[name]) for name in mine)
