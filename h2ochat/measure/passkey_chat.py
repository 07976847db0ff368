"""The pass key in a chat: a fact given in turn 1 of a conversation, asked for in turn N.

The conversation runs through ``h2ochat.chat.conversation.Conversation``, the REPL's own path (its prompt
rendering: the model's chat template, or a plain "User: / Assistant:" transcript for a base model;
each turn feeds only what is new; replies decoded greedily). Turn 1 is a user message stating the
key, turns 2..N-1 are stretches of filler text as user messages (together ``length`` tokens), each
answered with a short reply, and turn N asks for the key; the trial counts as recalled when the
reply's digits start with the key (``passkey.recalled``). A row is a ``passkey.CacheRow``: its cache
settings become the conversation's.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from ..chat.conversation import Conversation
from ..chat.settings import ChatSettings
from ..config import Sampling
from .passkey import CacheRow, cache_memory, filler_stretch, recalled, slots_fields

KEY_MESSAGE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION_MESSAGE = "What is the pass key? The pass key is"
REPLY_TOKENS = 8  # each filler turn's reply: short, to keep the run bounded
# the answer: a chat model answers in a sentence ("The pass key is 12345."), and some tokenizers
# (SmolLM2's) spell a number one digit per token
ANSWER_TOKENS = 16
TURN_OVERHEAD = 32  # tokens a turn's rendering may add around its message (roles, template marks), at most


@dataclass(frozen=True)
class ChatTrial:
    key: str
    fillers: tuple[str, ...]  # the user messages of turns 2..N-1
    length: int  # filler tokens in all
    window: int  # which stretch of the filler text

    @property
    def turns(self) -> int:
        return len(self.fillers) + 2

    @property
    def messages(self) -> list[str]:
        return [KEY_MESSAGE.format(key=self.key), *self.fillers, QUESTION_MESSAGE]

    @property
    def tokens_upper_bound(self) -> int:
        """Tokens the conversation reaches at most (for the position-limit check before running)."""
        return self.length + self.turns * (TURN_OVERHEAD + max(REPLY_TOKENS, ANSWER_TOKENS))


def make_chat_trials(tokenizer, text: str, lengths: Sequence[int], turns: int, keys: int,
                     seed: int = 0) -> list[ChatTrial]:
    """``keys`` trials per length, each with its own key and stretch of the filler, cut into
    ``turns - 2`` user messages of equal token counts."""
    if turns < 3:
        raise ValueError(f"a pass-key chat needs at least 3 turns (the key, filler, the question), got {turns}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    trials = []
    for length in lengths:
        if length < turns - 2:
            raise ValueError(f"--lengths {length} is fewer filler tokens than the {turns - 2} filler turns")
        for window in range(keys):
            key = f"{rng.randrange(10000, 100000)}"
            stretch = filler_stretch(ids, length, window, keys)
            cuts = [round(k * length / (turns - 2)) for k in range(turns - 1)]
            fillers = tuple(tokenizer.decode(stretch[a:b]).strip() for a, b in zip(cuts, cuts[1:]))
            trials.append(ChatTrial(key, fillers, length, window))
    return trials


def run_chat(model, tokenizer, row: CacheRow, trial: ChatTrial) -> dict:
    """One conversation of the trial's turns on the row's cache settings; its record."""
    settings = ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=REPLY_TOKENS, cache=row.settings)
    conversation = Conversation(model, tokenizer, settings)
    first_cache = row.instrument(conversation.cache)  # nothing fed yet
    started = time.perf_counter()
    replies = [conversation.send(message).text for message in trial.messages[:-1]]
    conversation.use_settings(replace(settings, max_new_tokens=ANSWER_TOKENS))
    answer = conversation.send(trial.messages[-1]).text
    record = {"row": row.label, "length": trial.length, "depth": 0.0, "turns": trial.turns, "window": trial.window,
              "key": trial.key, "answer": answer, "recalled": recalled(trial.key, answer),
              "tokens": len(conversation.ids), **slots_fields(row, len(conversation.ids)), "replies": replies,
              # a base model's reply that runs into the next "User:" is cut, and the next turn reads the
              # whole conversation again into a fresh cache (the chat path's own behaviour)
              "fresh_caches": int(conversation.cache is not first_cache),
              "seconds": round(time.perf_counter() - started, 2)}
    record.update(cache_memory(conversation.cache))
    return record


def run_chats(model, tokenizer, trials: Sequence[ChatTrial], rows: Sequence[CacheRow],
              on_trial: Callable | None = None, wanted: Callable | None = None) -> list[dict]:
    """One record per (row, trial), for the pairs ``wanted(row, trial)`` accepts (default: all)."""
    results = []
    for row in rows:
        for trial in trials:
            if wanted is not None and not wanted(row, trial):
                continue
            results.append(run_chat(model, tokenizer, row, trial))
            if on_trial is not None:
                on_trial(results[-1])
    return results


def describe(turns: int) -> dict:
    """The protocol, for the report."""
    return {"turns": turns, "turn_1": KEY_MESSAGE, "turns_between": "the filler, --lengths tokens in all, "
            f"as {turns - 2} user messages", f"turn_{turns}": QUESTION_MESSAGE, "reply_tokens": REPLY_TOKENS,
            "answer_tokens": ANSWER_TOKENS,
            "replies": "greedy, through h2ochat.chat.Conversation"}
