"""A fake model behind the serve scheduler's Backend interface, and a fake tokenizer: the scheduler's
decisions (admission, chunks, recycling, cancelling) are tested without torch models."""

from __future__ import annotations

import torch

from h2ochat.engine.generation import Sampling
from h2ochat.serve.api import RequestParams
from h2ochat.serve.sequence import Prepared, Request

VOCAB = 40
# the words of the chats the HTTP tests send (the clean checkpoint's replies are made of such text)
WORDS = ("the quick brown fox jumps over lazy dog once upon a time there was dragon who lived in cave "
         "and ate gold every day").split()


def words(rng, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def chat_beside_the_repl(client, model: str, repl, rng, turns: int = 4, max_tokens: int = 12):
    """A chat sent turn after turn to a live server (``client``, greedy) and to the REPL's ``repl``
    (a ``chat.Conversation``): yields (turn, the server's reply, the REPL's turn result) each turn."""
    messages = []
    for turn in range(turns):
        user = words(rng, rng.randint(3, 9))
        expected = repl.send(user)
        messages.append({"role": "user", "content": user})
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
        yield turn, reply, expected
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})


class FakeTokenizer:
    """Token i is the text "<i>"."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{int(i)}>" for i in ids)


def next_token(history: list[int], salt: int = 0) -> int:
    """The fake model's greedy choice: a function of everything the row has read."""
    return (sum(history) * 7 + len(history) + salt) % (VOCAB - 4) + 4  # never 0-3 (3 is the stop id)


def one_hot(token: int) -> torch.Tensor:
    logits = torch.zeros(VOCAB)
    logits[token] = 10.0
    return logits


class FakeJob:
    def __init__(self, request):
        self.request, self.fed = request, 0


def power_of_two_buckets(rows: int) -> list[int]:
    """1, 2, 4, ... below ``rows``, then ``rows``: the real backend's default decode sizes."""
    sizes, size = [], 1
    while size < rows:
        sizes.append(size)
        size *= 2
    return sizes + [rows]


class FakeBackend:
    """Rows hold the list of tokens they have read; prefill feeds ``chunk`` tokens a call; a decode
    step runs the smallest of ``buckets`` (default 1, 2, 4, ...) that holds the rows in use."""

    def __init__(self, rows: int, chunk: int = 4, buckets: list[int] | None = None):
        self.rows, self.chunk = rows, chunk
        self.buckets = buckets or power_of_two_buckets(rows)
        self.state: list[list[int] | None] = [None] * rows
        self.log: list[tuple] = []  # ("prefill", request id, tokens) / ("decode", rows in use) / ("move", from, to)
        self.ran: list[int] = []  # rows each decode step ran
        self.released: list[tuple[int, object]] = []
        self.aborted: list[object] = []
        self.fail_prefill = self.fail_decode = False
        self.mix = False  # run a prompt chunk and the decode step as one "forward" (``mixed``)
        self.poisoned: set[int] = set()  # rows whose next logits are NaN (a broken model)

    def begin(self, request):
        request.fed_ids = list(request.prompt_ids)
        self.log.append(("begin", request.id))
        return FakeJob(request)

    def prefill(self, job):
        if self.fail_prefill:
            raise RuntimeError("prefill broke")
        ids = job.request.prompt_ids
        piece = ids[job.fed: job.fed + self.chunk]
        job.fed += len(piece)
        self.log.append(("prefill", job.request.id, len(piece)))
        return one_hot(next_token(ids)) if job.fed == len(ids) else None

    def placement(self, job, free, count):
        return free[:count]

    def install(self, job, rows):
        for row in rows:
            assert self.state[row] is None, "a row was installed while in use"
            self.state[row] = list(job.request.prompt_ids)

    def abort(self, job):
        self.aborted.append(job)

    def bucket(self, rows):
        return min(size for size in self.buckets if size >= rows)

    def move(self, source, target):
        assert self.state[source] is not None and self.state[target] is None, "a move must fill a free row"
        self.state[target], self.state[source] = self.state[source], None
        self.log.append(("move", source, target))

    def decode(self, tokens):
        if self.fail_decode:
            raise RuntimeError("decode broke")
        assert len(tokens) == self.rows
        for row, history in enumerate(self.state):
            assert (tokens[row] is None) == (history is None), "a free row was fed, or a row in use was not"
        in_use = [row for row, s in enumerate(self.state) if s is not None]
        size = self.bucket(in_use[-1] + 1)
        self.log.append(("decode", tuple(in_use)))
        self.ran.append(size)
        logits = torch.zeros(size, VOCAB)
        for row in in_use:
            self.state[row].append(tokens[row])
            logits[row] = one_hot(next_token(self.state[row]))
            if row in self.poisoned:
                logits[row, 5] = float("nan")
        return logits

    def mixes(self, job):
        return self.mix

    def mixed(self, job, tokens):
        logits = self.prefill(job)
        decoded = self.decode(tokens)
        self.log.append(("mixed",))
        return logits, decoded

    def release(self, row, choice):
        self.released.append((row, choice))
        self.state[row] = None

    def evicted(self, row):
        return 0

    def recalled(self, row):
        return 0


def greedy_alone(prompt: list[int], tokens: int) -> list[int]:
    """What one request generates on the fake model, by itself."""
    history, out = list(prompt), []
    token = next_token(history)
    out.append(token)
    while len(out) < tokens:
        history.append(token)
        token = next_token(history)
        out.append(token)
    return out


def make_request(prompt: list[int], *, max_tokens: int = 5, n: int = 1, stop: list[str] | None = None,
                 temperature: float = 0.0, seed: int | None = None, stop_ids=frozenset({3})):
    events: list[tuple] = []
    params = RequestParams(kind="completion", model="fake", prompt=prompt, max_tokens=max_tokens, n=n,
                           stop=stop or [], temperature=temperature, seed=seed)
    prepared = Prepared(params, list(prompt), None, max_tokens, Sampling(temperature=temperature, seed=seed))
    request = Request(prepared, emit=events.append, stop_ids=frozenset(stop_ids), tokenizer=FakeTokenizer())
    request.events = events
    return request


def generated(request) -> list[list[int]]:
    return [choice.generated for choice in request.choices]


def finishes(request) -> list[tuple]:
    return [event for event in request.events if event[0] == "finish"]


def model_engine(model, rows: int, *, policy: str = "h2o", budget: str = "12", store=None, chunk: int = 5,
                 store_bytes: int = 1 << 24, cache: dict | None = None, **kwargs):
    """A scheduler over a real ``ModelBackend`` of ``rows`` rows (kwargs: the backend's, e.g. buckets=;
    ``cache``: more ``CacheSettings`` fields, e.g. recall=) and its parked store."""
    from h2ochat.engine.generation import CacheSettings
    from h2ochat.serve.backend import ModelBackend
    from h2ochat.serve.parked import ParkedStore
    from h2ochat.serve.scheduler import Scheduler

    store = store if store is not None else ParkedStore(store_bytes)
    backend = ModelBackend(model, CacheSettings(policy=policy, budget=budget, **(cache or {})), rows, store=store,
                           prefill_chunk=chunk, **kwargs)
    return Scheduler(backend), store


def random_prompt(rng, low: int, high: int, vocab: int) -> list[int]:
    """A prompt of ``low`` to ``high`` token ids below ``vocab`` drawn by ``rng`` (none of the first three:
    special in the tiny models' vocabulary)."""
    return [rng.randrange(3, vocab) for _ in range(rng.randint(low, high))]


def served(scheduler, ids: list[int], tokens: int):
    """A greedy request for ``ids`` with ``tokens`` to generate and no stop, run until the engine is idle."""
    request = make_request(ids, max_tokens=tokens, stop_ids=())
    scheduler.submit(request)
    drain(scheduler)
    return request


def drain(scheduler, limit: int = 3000) -> None:
    """Step the scheduler until nothing is left to do (a bound, so a stuck engine fails the test)."""
    for _ in range(limit):
        if scheduler.idle:
            return
        scheduler.step()
    raise AssertionError("the engine did not finish")
