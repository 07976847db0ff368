"""The serve scheduler with a fake model: admission, one prefill chunk per step, recycling rows,
cancelling waiting, prefilling and running requests, failures that leave the engine serving, rows in
use moved down so a decode step runs the smallest bucket that holds them."""

from __future__ import annotations

import random

import pytest

from h2ochat.serve.scheduler import Scheduler

from serve_fakes import FakeBackend, finishes, generated, greedy_alone, make_request


def run_until_idle(scheduler: Scheduler, limit: int = 500) -> int:
    steps = 0
    while not scheduler.idle:
        scheduler.step()
        steps += 1
        assert steps < limit, "the scheduler did not finish"
    return steps


def random_prompt(rng: random.Random, low: int = 1, high: int = 12) -> list[int]:
    return [rng.randrange(4, 40) for _ in range(rng.randint(low, high))]


def test_admission_waits_for_a_free_row_and_each_request_equals_itself_alone(seed):
    rng = random.Random(seed)
    backend = FakeBackend(rows=2)
    scheduler = Scheduler(backend)
    # the first runs long enough for the second to join it (its prompt is read in 3 steps at most)
    requests = [make_request(random_prompt(rng), max_tokens=20 if number == 0 else rng.randint(1, 6))
                for number in range(5)]
    for request in requests:
        scheduler.submit(request)
    busiest = 0
    while not scheduler.idle:
        scheduler.step()
        busiest = max(busiest, scheduler.rows_in_use)
        assert sum(state is not None for state in backend.state) == scheduler.rows_in_use
    assert busiest == 2
    for request in requests:
        assert generated(request) == [greedy_alone(request.prompt_ids, request.prepared.max_tokens)]
        assert finishes(request) == [("finish", 0, "length")]
        assert request.events[-1][0] == "done"
    # first come, first served: the order of admission is the order of submission
    begun = [entry[1] for entry in backend.log if entry[0] == "begin"]
    assert begun == [request.id for request in requests]


def test_a_long_prompt_is_fed_one_chunk_per_step_beside_the_running_rows(seed):
    rng = random.Random(seed)
    backend = FakeBackend(rows=2, chunk=4)
    scheduler = Scheduler(backend)
    first = make_request(random_prompt(rng, 2, 4), max_tokens=40)
    scheduler.submit(first)
    scheduler.step()  # read and installed: its first token
    newcomer = make_request(random_prompt(rng, 17, 30), max_tokens=3)
    scheduler.submit(newcomer)
    before = len(first.choices[0].generated)
    chunks = -(-len(newcomer.prompt_ids) // 4)
    for _ in range(chunks):
        scheduler.step()
    # every step of the newcomer's reading was also a decode step of the running row
    assert len(first.choices[0].generated) == before + chunks
    per_step = [entry for entry in backend.log if entry[0] in ("prefill", "decode")]
    for earlier, later in zip(per_step, per_step[1:]):
        assert not (earlier[0] == "prefill" and later[0] == "prefill"), "two prefill chunks in one step"
    run_until_idle(scheduler)
    assert generated(first) == [greedy_alone(first.prompt_ids, 40)]
    assert generated(newcomer) == [greedy_alone(newcomer.prompt_ids, 3)]


def test_a_finished_row_is_recycled_and_parked(seed):
    rng = random.Random(seed)
    backend = FakeBackend(rows=1)
    scheduler = Scheduler(backend)
    a, b = make_request(random_prompt(rng), max_tokens=3), make_request(random_prompt(rng), max_tokens=4)
    scheduler.submit(a)
    scheduler.submit(b)
    run_until_idle(scheduler)
    assert [(row, choice.request) for row, choice in backend.released] == [(0, a), (0, b)]
    assert generated(b) == [greedy_alone(b.prompt_ids, 4)]  # nothing of a's row leaked into b's
    assert scheduler.rows == [None]


def test_a_stop_token_ends_the_choice_and_frees_the_row():
    backend = FakeBackend(rows=1)
    scheduler = Scheduler(backend)
    prompt = [5, 6]
    expected = greedy_alone(prompt, 3)
    request = make_request(prompt, max_tokens=10, stop_ids={expected[2]})
    scheduler.submit(request)
    run_until_idle(scheduler)
    assert generated(request) == [expected]
    assert finishes(request) == [("finish", 0, "stop")]
    assert scheduler.rows == [None]


def test_cancelling_a_waiting_request_never_starts_it():
    backend = FakeBackend(rows=1)
    scheduler = Scheduler(backend)
    running, waiting = make_request([5, 6, 7], max_tokens=20), make_request([8, 9], max_tokens=20)
    scheduler.submit(running)
    scheduler.submit(waiting)
    scheduler.step()
    scheduler.cancel(waiting)
    assert finishes(waiting) == [("finish", 0, "cancelled")] and waiting.events[-1][0] == "done"
    run_until_idle(scheduler)
    assert ("begin", waiting.id) not in backend.log
    assert generated(running) == [greedy_alone(running.prompt_ids, 20)]


def test_cancelling_a_running_request_frees_its_row_and_leaves_the_others_alone(seed):
    rng = random.Random(seed)
    backend = FakeBackend(rows=3, buckets=[3])  # every step runs all rows: nothing moves into the freed row
    scheduler = Scheduler(backend)
    requests = [make_request(random_prompt(rng), max_tokens=30) for _ in range(3)]
    for request in requests:
        scheduler.submit(request)
    while scheduler.rows_in_use < 3:  # all three running (each prompt takes up to 3 steps to read)
        scheduler.step()
    scheduler.step()
    victim = requests[1]
    row = victim.choices[0].row
    assert scheduler.rows[row] is victim.choices[0]
    scheduler.cancel(victim)
    assert scheduler.rows[row] is None and backend.state[row] is None  # free before the next step
    assert backend.released[-1] == (row, victim.choices[0])  # parked: what it read so far is kept
    assert finishes(victim) == [("finish", 0, "cancelled")]
    late = make_request(random_prompt(rng), max_tokens=5)
    scheduler.submit(late)
    run_until_idle(scheduler)
    assert late.choices[0].row == row  # the freed row took the newcomer
    for request in (requests[0], requests[2], late):
        assert generated(request) == [greedy_alone(request.prompt_ids, request.prepared.max_tokens)]


def test_cancelling_a_request_being_prefilled_drops_its_job():
    backend = FakeBackend(rows=1, chunk=2)
    scheduler = Scheduler(backend)
    request = make_request(list(range(4, 20)), max_tokens=5)
    scheduler.submit(request)
    scheduler.step()
    assert scheduler.admitting is request
    scheduler.cancel(request)
    assert len(backend.aborted) == 1 and scheduler.job is None
    assert scheduler.idle and backend.state == [None]
    assert finishes(request) == [("finish", 0, "cancelled")]


def test_n_choices_take_n_rows_and_wait_for_them():
    backend = FakeBackend(rows=3)
    scheduler = Scheduler(backend)
    first = make_request([4, 5], max_tokens=6)
    triple = make_request([6, 7, 8], max_tokens=4, n=3)
    scheduler.submit(first)
    scheduler.submit(triple)
    scheduler.step()
    scheduler.step()
    assert scheduler.admitting is None and triple in scheduler.waiting  # 2 rows free, 3 needed
    run_until_idle(scheduler)
    assert generated(triple) == [greedy_alone(triple.prompt_ids, 4)] * 3  # greedy: three equal choices
    assert sorted(event[1] for event in finishes(triple)) == [0, 1, 2]
    with pytest.raises(ValueError):
        scheduler.submit(make_request([4], n=4))


def test_sampled_choices_follow_their_seeds():
    def run(seed):
        backend = FakeBackend(rows=2)
        scheduler = Scheduler(backend)
        request = make_request([4, 5, 6], max_tokens=12, n=2, temperature=1.0, seed=seed)
        scheduler.submit(request)
        run_until_idle(scheduler)
        return generated(request)

    # the fake logits are one-hot at 10: a temperature of 1 still leaves other tokens a chance
    assert run(11) == run(11)


def test_a_failing_prefill_fails_its_request_only():
    backend = FakeBackend(rows=2)
    scheduler = Scheduler(backend)
    running = make_request([4, 5], max_tokens=10)
    scheduler.submit(running)
    scheduler.step()
    backend.fail_prefill = True
    broken = make_request([6, 7], max_tokens=3)
    scheduler.submit(broken)
    scheduler.step()
    backend.fail_prefill = False
    assert broken.events[-1][0] == "error" and broken.events[-1][1].status == 500
    run_until_idle(scheduler)
    assert generated(running) == [greedy_alone(running.prompt_ids, 10)]


def test_a_failing_decode_fails_the_batch_and_frees_every_row():
    backend = FakeBackend(rows=2)
    scheduler = Scheduler(backend)
    requests = [make_request([4, 5], max_tokens=10), make_request([6], max_tokens=10)]
    for request in requests:
        scheduler.submit(request)
    scheduler.step()
    scheduler.step()
    backend.fail_decode = True
    scheduler.step()
    backend.fail_decode = False
    assert all(request.events[-1][0] == "error" for request in requests)
    assert scheduler.rows == [None, None] and backend.state == [None, None]
    after = make_request([7, 8], max_tokens=4)
    scheduler.submit(after)
    run_until_idle(scheduler)
    assert generated(after) == [greedy_alone([7, 8], 4)]


def test_a_decode_step_runs_the_smallest_bucket_holding_the_rows_in_use(seed):
    """Rows in use are moved down into free rows whenever that lets the step run fewer rows (buckets
    1, 2, 4, 8): every step runs the smallest bucket that holds as many rows as are in use, and the
    moved requests go on as if never moved."""
    rng = random.Random(seed)
    backend = FakeBackend(rows=8, chunk=4)
    scheduler = Scheduler(backend)
    # the first ends before the second (whose row is then moved down), the others at random
    requests = [make_request(random_prompt(rng, 1, 4), max_tokens=8), make_request(random_prompt(rng, 1, 4), max_tokens=30)]
    requests += [make_request(random_prompt(rng), max_tokens=rng.randint(1, 25)) for _ in range(8)]
    for request in requests[:2]:
        scheduler.submit(request)
    while not requests[0].finished:
        scheduler.step()
    scheduler.step()
    assert backend.log[-2:] == [("move", 1, 0), ("decode", (0,))] and backend.ran[-1] == 1
    for request in requests[2:]:
        for _ in range(rng.randint(0, 5)):
            scheduler.step()
        scheduler.submit(request)
    run_until_idle(scheduler)
    decodes = [entry for entry in backend.log if entry[0] == "decode"]
    assert [backend.bucket(len(entry[1])) for entry in decodes] == backend.ran
    for request in requests:
        assert generated(request) == [greedy_alone(request.prompt_ids, request.prepared.max_tokens)]
