"""Multi-turn memory through the real chat path: facts planted in the first turns of a conversation,
asked for in later turns with filler turns between, scored per fact.

The conversation is ``h2ochat.chat.conversation.Conversation``, as ``run`` drives it (the model's chat template,
the history, the cache of the row's settings; each turn feeds only what is new; replies greedy).
A sample plants ``FACTS`` key-value records, one user turn each ("Record: the locker code of Maria is
4821."), then ``depth`` filler turns (synthetic small talk: RULER's repeated noise sentences, so
they hold no fact), then asks for each record in its own turn, phrased as a completion ("Complete
the record: the locker code of Maria is"): a small model completes a record it can see, where it does
not answer a question about it. A fact counts as recalled when the reply's digits start with its
code. The depth is the number of filler turns between the last fact and the first question."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Sequence

from ..chat.conversation import Conversation
from ..chat.settings import ChatSettings
from ..config import Sampling
from .passkey import recalled

TASK = "chat-memory"
FACTS = 3
NAMES = ("Maria", "Tomas", "Aiko", "Kwame", "Lena", "Ravi", "Sofia", "Omar", "Ingrid", "Chen", "Nadia", "Pablo")
THINGS = ("locker code", "room number", "badge number", "gate code", "desk number", "order number")
FACT_MESSAGE = "Record: the {thing} of {name} is {code}."
QUESTION_MESSAGE = "Complete the record: the {thing} of {name} is"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
REPLY_TOKENS = 8  # the replies to facts and filler: short, to bound the run
ANSWER_TOKENS = 12


@dataclass(frozen=True)
class Fact:
    thing: str
    name: str
    code: str

    @property
    def message(self) -> str:
        return FACT_MESSAGE.format(thing=self.thing, name=self.name, code=self.code)

    @property
    def question(self) -> str:
        return QUESTION_MESSAGE.format(thing=self.thing, name=self.name)


@dataclass(frozen=True)
class ChatSample:
    depth: int  # filler turns between the facts and the questions
    index: int
    facts: tuple[Fact, ...]
    fillers: tuple[str, ...]

    task = TASK

    @property
    def length(self) -> int:  # the log's length field: the depth
        return self.depth


def parse_depths(text: str) -> list[int]:
    try:
        depths = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--turns takes comma-separated filler-turn counts (0,4,8), got {text!r}") from None
    if not depths or min(depths) < 0:
        raise ValueError(f"--turns needs counts of filler turns of at least 0, got {text!r}")
    return list(dict.fromkeys(depths))


def make_samples(depths: Sequence[int], count: int, filler_words: int = 120, seed: int = 0) -> list[ChatSample]:
    """``count`` samples per depth, each with its own facts (distinct names and things) and filler,
    drawn from its own seed (``seed``, depth, index): sample 3 is the same whatever ``count`` is, so a log
    grown with another ``--samples`` scores the same conversations."""
    noise = NOISE.split(". ")
    samples = []
    for depth in depths:
        for index in range(count):
            rng = random.Random(f"{seed}:{depth}:{index}")
            people = rng.sample(NAMES, FACTS)
            things = rng.sample(THINGS, FACTS)
            facts = tuple(Fact(thing, name, str(rng.randrange(1000, 10000))) for thing, name in zip(things, people))
            fillers = []
            for _ in range(depth):
                words: list[str] = []
                while len(words) < filler_words:
                    words += (rng.choice(noise).rstrip(".") + ".").split()
                fillers.append(" ".join(words[:filler_words]))
            samples.append(ChatSample(depth, index, facts, tuple(fillers)))
    return samples


def run_sample(model, tokenizer, row, sample: ChatSample) -> dict:
    """One conversation on the row's cache settings (``passkey.CacheRow``); its log record."""
    settings = ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=REPLY_TOKENS, cache=row.settings)
    conversation = Conversation(model, tokenizer, settings)
    started = time.perf_counter()
    for message in [fact.message for fact in sample.facts] + list(sample.fillers):
        conversation.send(message)
    conversation.use_settings(replace(settings, max_new_tokens=ANSWER_TOKENS))
    answers = [conversation.send(fact.question).text for fact in sample.facts]
    each = [recalled(fact.code, answer) for fact, answer in zip(sample.facts, answers)]
    return {"row": row.label, "task": TASK, "length": sample.depth, "sample": sample.index,
            "answer": answers, "outputs": [fact.code for fact in sample.facts], "recalled_each": each,
            "score": sum(each) / len(each), "tokens": len(conversation.ids),
            "seconds": round(time.perf_counter() - started, 2)}
