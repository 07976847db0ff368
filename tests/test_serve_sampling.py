"""The server's batch sampler (serve/sampling.py) against each row drawn alone, the exponential race's
draws against the distribution they race over, its refusal
of a generator or window on another device than the logits (what made every sampled request fail on
a GPU: the choices drew with CPU generators from device logits), and failures that stay with their
request: a row whose sampling fails is left out, the others draw what they would have drawn anyway."""

from __future__ import annotations

import math
import random

import pytest
import torch

from h2ochat.engine.generation import Sampling, sample, token_probs
from h2ochat.engine.repetition import RecentTokens
from h2ochat.serve.sampling import SamplingDeviceError, _without_non_finite_rows, sample_rows
from h2ochat.serve.scheduler import Scheduler

from serve_fakes import VOCAB, FakeBackend, generated, greedy_alone, make_request, next_token, one_hot


class Row:
    """A stand-in for a ``Choice``: settings, a seed, and the prompt tokens its window starts from."""

    def __init__(self, sampling: Sampling, seed: int, fed: list[int]):
        self.sampling, self.seed, self.fed = sampling, seed, fed
        self.generator = self.window = None
        self.asked: list[torch.device] = []

    def generator_on(self, device):
        self.asked.append(device)
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def window_on(self, device, vocab):
        if self.window is None:
            self.window = RecentTokens(torch.tensor([self.fed], device=device), None, vocab, self.sampling.repeat_last_n)
        return self.window


def random_sampling(rng: random.Random) -> Sampling:
    return Sampling(temperature=rng.choice([0.0, 0.0, 0.7, 1.0, 1.4]), top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
                    top_k=rng.choice([0, 0, 5]), repetition_penalty=rng.choice([1.0, 1.3]),
                    repeat_last_n=rng.choice([0, 4, 64]))


class Reference:
    """One row sampled alone: its own CPU generator seeded the same, its window from the same prompt
    tokens; greedy, ``generation.sample`` on [1, V]; sampling, the race written out for one row:
    argmax(p / E) over its distribution, E a fresh Exponential(1) per entry from its generator."""

    def __init__(self, row: Row, vocab: int):
        self.sampling = row.sampling
        self.generator = torch.Generator().manual_seed(row.seed)
        self.seen = None
        if row.sampling.repetition_penalty != 1.0:
            self.seen = RecentTokens(torch.tensor([row.fed]), None, vocab, row.sampling.repeat_last_n)

    def draw(self, logits: torch.Tensor) -> int:
        if self.sampling.temperature == 0:
            token = sample(logits.view(1, -1), self.sampling, None, self.seen)
        else:
            probs = token_probs(logits.view(1, -1), self.sampling, self.seen)[0]
            noise = torch.empty(probs.shape[-1]).exponential_(generator=self.generator)
            token = (probs / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax().view(1)
        if self.seen is not None:
            self.seen.push(token)
        return int(token[0])


def random_rows(rng: random.Random, count: int, vocab: int) -> list[Row]:
    return [Row(random_sampling(rng), rng.randrange(2**31), [rng.randrange(vocab) for _ in range(rng.randint(1, 9))])
            for _ in range(count)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batch_sampler_draws_what_each_row_draws_alone(seed, dtype):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    vocab = rng.randint(20, 300)
    rows = random_rows(rng, rng.randint(1, 9), vocab)
    references = [Reference(row, vocab) for row in rows]
    for _ in range(6):  # steps: the generators and windows carry on from one to the next
        logits = (torch.randn(len(rows), vocab, generator=generator) * rng.choice([0.5, 3.0])).to(dtype)
        assert sample_rows(logits, rows) == [ref.draw(logits[i]) for i, ref in enumerate(references)]
    for row, ref in zip(rows, references):
        if ref.seen is not None:
            assert torch.equal(row.window.counts, ref.seen.counts)
        assert row.asked == [torch.device("cpu")] * len(row.asked)  # made where the logits are


def test_the_race_draws_each_token_with_its_probability(seed):
    """Many rows racing over one known distribution, each with its own generator: the tokens' counts
    match the probabilities (within 5 standard deviations of a binomial count), top-p's cut included."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, generator=generator) * 2
    sampling = Sampling(temperature=0.8, top_p=0.9)
    probs = token_probs(logits.view(1, -1), sampling)[0]
    rows = [Row(sampling, seed * 7919 + number, [1]) for number in range(4000)]
    drawn = torch.tensor(sample_rows(logits.expand(len(rows), -1).clone(), rows))
    counts = torch.bincount(drawn, minlength=12).double()
    expected = probs.double() * len(rows)
    spread = (expected * (1 - probs.double())).sqrt()
    assert bool((counts[probs == 0] == 0).all())  # nothing past top-p is ever drawn
    assert bool(((counts - expected).abs() <= 5 * spread + 1).all()), (counts, expected)


def test_a_seeded_row_draws_the_same_tokens_whatever_its_neighbours(seed):
    """A row's tokens depend on its seed and its logits only: alone, or at any place among any number
    of neighbours with any settings (greedy, other temperatures, penalties), step after step."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    vocab = rng.randint(20, 200)
    mine = Sampling(temperature=0.9, top_p=0.95, repetition_penalty=1.2, repeat_last_n=8)
    steps = [torch.randn(vocab, generator=generator) * 2 for _ in range(8)]
    runs = []
    for neighbours in (0, 1, 5, 9):
        me = Row(mine, 1234, [1, 2, 3])
        others = random_rows(rng, neighbours, vocab)
        place = rng.randint(0, neighbours)
        batch = others[:place] + [me] + others[place:]
        tokens = []
        for logits in steps:
            step = torch.randn(len(batch), vocab, generator=generator)
            step[place] = logits
            tokens.append(sample_rows(step, batch)[place])
        runs.append(tokens)
    assert all(run == runs[0] for run in runs)


def test_the_sampler_refuses_a_generator_or_window_on_another_device():
    """Logits on the meta device stand in for a GPU's: torch samples them with a CPU generator without a
    word (a GPU raises, and the server failed every request of the batch): the sampler refuses it."""
    logits = torch.zeros(1, VOCAB, device="meta")

    class CpuGenerator(Row):
        def generator_on(self, device):
            self.asked.append(device)
            return torch.Generator().manual_seed(self.seed)

    row = CpuGenerator(Sampling(temperature=1.0), 5, [4])
    [result] = sample_rows(logits, [row])
    assert isinstance(result, SamplingDeviceError) and row.asked == [torch.device("meta")]
    assert "cpu" in str(result) and "meta" in str(result)

    class CpuWindow(Row):
        def window_on(self, device, vocab):
            return RecentTokens(torch.tensor([self.fed]), None, vocab, 8)

    [result] = sample_rows(logits, [CpuWindow(Sampling(repetition_penalty=1.2), 5, [4])])
    assert isinstance(result, SamplingDeviceError) and "window" in str(result)


def test_a_row_whose_sampling_fails_is_left_out_and_the_others_draw_as_without_it(seed):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    vocab = 50
    shared = Sampling(temperature=1.0, top_p=0.9, repetition_penalty=1.2)
    rows = [Row(shared, rng.randrange(2**31), [rng.randrange(vocab)]) for _ in range(5)]
    references = [Reference(row, vocab) for row in rows]
    nan_row, broken_row = 1, 3

    def broken_mask():
        return torch.zeros(1, vocab + 1, dtype=torch.bool)  # the wrong width: token_probs raises

    for step in range(4):
        logits = torch.randn(len(rows), vocab, generator=generator)
        logits[nan_row, rng.randrange(vocab)] = float("nan")
        if step == 1:  # the group raises: every row's distribution is made again alone (nothing drawn yet)
            rows[broken_row].window_on(torch.device("cpu"), vocab).mask = broken_mask
        results = sample_rows(logits, rows)
        assert isinstance(results[nan_row], FloatingPointError)
        for index, (result, ref) in enumerate(zip(results, references)):
            if index == nan_row or (index == broken_row and step >= 1):
                continue
            assert result == ref.draw(logits[index])
        if step >= 1:
            assert isinstance(results[broken_row], RuntimeError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_broken_rows_are_those_a_row_by_row_check_finds(seed, dtype):
    """Rows holding NaN, +inf, nothing but -inf, some -inf among finite values (not broken), -inf beside +inf,
    a NaN beside -inf: the rows the sampler sets aside are the ones a slow check of each value finds."""
    rng = random.Random(seed)
    special = [float("nan"), float("inf"), float("-inf")]
    logits = torch.randn(40, 30, generator=torch.Generator().manual_seed(seed)).to(dtype)
    for row in range(logits.shape[0]):
        if row % 5 == 0:
            logits[row] = float("-inf")
        for _ in range(rng.randrange(4)):
            logits[row, rng.randrange(logits.shape[1])] = rng.choice(special)
    want = [any(math.isnan(x) or x == math.inf for x in row) or all(x == -math.inf for x in row)
            for row in logits.float().tolist()]
    cleaned, broken = _without_non_finite_rows(logits)
    assert broken.tolist() == want and 0 < sum(want) < len(want)
    assert torch.equal(cleaned[broken], torch.zeros_like(cleaned[broken]))
    assert torch.equal(cleaned[~broken], logits[~broken])


def test_a_request_whose_sampling_fails_fails_alone_and_its_row_is_reused():
    backend = FakeBackend(rows=4)
    scheduler = Scheduler(backend)
    greedy = make_request([4, 5, 6], max_tokens=12)
    sampled = make_request([7, 8], max_tokens=12, temperature=1.0, seed=3, stop_ids=())
    poisoned = make_request([9, 10], max_tokens=12, temperature=1.0, seed=4)
    misplaced = make_request([11], max_tokens=12, temperature=0.5, seed=5)
    for request in (greedy, sampled, poisoned, misplaced):
        scheduler.submit(request)
    while scheduler.rows_in_use < 4:
        scheduler.step()
    backend.poisoned.add(poisoned.choices[0].row)

    class OtherDevice:  # a generator made on another device than the logits (as the server did on a GPU)
        device = torch.device("meta")

    misplaced.choices[0].generator = OtherDevice()
    rows = {poisoned.choices[0].row, misplaced.choices[0].row}
    scheduler.step()
    backend.poisoned.clear()
    assert poisoned.events[-1][0] == "error" and "NaN" in poisoned.events[-1][1].message
    assert misplaced.events[-1][0] == "error" and "device" in misplaced.events[-1][1].message
    assert not any(choice is not None and choice.request in (poisoned, misplaced) for choice in scheduler.rows)
    assert {(row, None) for row in rows} <= set(backend.released)  # freed, nothing parked
    later = make_request([12, 13], max_tokens=5)
    scheduler.submit(later)
    while not scheduler.idle:
        scheduler.step()
    for request in (greedy, later):
        assert generated(request) == [greedy_alone(request.prompt_ids, request.prepared.max_tokens)]
    alone = make_request([7, 8], max_tokens=12, temperature=1.0, seed=3, stop_ids=())
    solo = Scheduler(FakeBackend(rows=1))
    solo.submit(alone)
    while not solo.idle:
        solo.step()
    assert generated(sampled) == generated(alone) and sampled.events[-1][0] == "done"


def test_a_seeded_request_draws_what_its_rows_draw_alone(seed):
    """Each choice k of a request seeded s draws from a CPU generator seeded s + k with the request's
    repetition window, as that row alone draws (``Reference``)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 8))]
    request = make_request(prompt, max_tokens=15, n=2, temperature=0.9, seed=seed % 1000, stop_ids=())
    sampling = Sampling(temperature=0.9, seed=seed % 1000, repetition_penalty=1.4, repeat_last_n=5)
    request.prepared.sampling = sampling
    for choice in request.choices:
        choice.sampling = sampling
    scheduler = Scheduler(FakeBackend(rows=3))
    scheduler.submit(request)
    while not scheduler.idle:
        scheduler.step()
    for k, tokens in enumerate(generated(request)):
        ref = Reference(Row(sampling, seed % 1000 + k, prompt), VOCAB)
        history, expected = list(prompt), []
        for _ in range(15):  # the fake model's logits, fed each drawn token
            expected.append(ref.draw(one_hot(next_token(history))))
            history.append(expected[-1])
        assert tokens == expected
