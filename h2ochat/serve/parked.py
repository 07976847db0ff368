"""Caches of finished conversations, parked in host memory until the conversation comes back.

OpenAI clients resend the whole conversation every turn. When a request's tokens extend a parked
conversation (the longest parked token sequence that is a prefix of the request's), the engine
imports that cache into the request's row and feeds only the tokens past it: a chat costs its new
tokens, not its history. Entries are kept least recently used first out, bounded in bytes.

An entry is taken (removed) when a request resumes it: the conversation moves into a row and comes
back, longer, when that request ends. Two requests never resume the same cache concurrently.

An entry may rest in the batch row that ran it (``Parked.row``; ``serve.rows``): its state is that row's,
not copied out, and it costs no bytes here until the row is wanted for another conversation, when the
state is copied out (``settle``) and counted like any other.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Parked:
    tokens: tuple[int, ...]  # the conversation's tokens (prompt and reply)
    fed: int  # how many of them the cache has seen (the rest are fed first on resuming)
    text: str | None  # the text the tokens spell (None: a prompt given as token ids)
    state: object  # the row's cache state (H2OCache.export_row), host memory; None while it rests in ``row``
    nbytes: int  # host bytes of ``state`` (0 while it rests in a row)
    row: int | None = None  # the batch row still holding the state, when it was not copied out yet


class ParkedStore:
    """LRU store of ``Parked`` conversations keyed by their tokens, at most ``capacity`` bytes.

    Thread-safe: the engine parks and takes, request handlers look texts up while tokenizing.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], Parked] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def resting(self) -> int:
        """Entries resting in a batch row (no host bytes of their own yet)."""
        with self._lock:
            return sum(entry.row is not None for entry in self._entries.values())

    def park(self, entry: Parked) -> bool:
        """Keep ``entry`` (replacing one with the same tokens), dropping the least recently used
        entries to stay within capacity; False when the entry alone is larger than the store."""
        with self._lock:
            old = self._entries.pop(entry.tokens, None)
            if old is not None:
                self._bytes -= old.nbytes
            if self.capacity <= 0 or entry.nbytes > self.capacity:
                return False
            self._make_room(entry.nbytes)
            self._entries[entry.tokens] = entry
            self._bytes += entry.nbytes
            return True

    def _make_room(self, nbytes: int) -> None:
        """Drop the least recently used entries that hold bytes until ``nbytes`` more fit (an entry resting
        in a row frees nothing here: it stays)."""
        while self._bytes + nbytes > self.capacity:
            key = next((key for key, entry in self._entries.items() if entry.nbytes), None)
            if key is None:
                return
            self._bytes -= self._entries.pop(key).nbytes

    def holds(self, entry: Parked) -> bool:
        """Whether ``entry`` itself is still here (not taken, replaced or dropped)."""
        with self._lock:
            return self._entries.get(entry.tokens) is entry

    def settle(self, entry: Parked, state: object, nbytes: int) -> bool:
        """``entry``, which rested in a row, now holds ``state`` (copied out of the row, ``nbytes`` host
        bytes), counted and made room for like a newly parked entry, in its place in the order; False when
        it is no longer here or alone larger than the store (then it is dropped)."""
        with self._lock:
            if self._entries.get(entry.tokens) is not entry:
                return False
            entry.state, entry.row = state, None
            if nbytes > self.capacity:
                del self._entries[entry.tokens]
                return False
            self._make_room(nbytes)
            entry.nbytes = nbytes
            self._bytes += nbytes
            return True

    def aligned(self, text: str) -> Parked | None:
        """The entry whose text is the longest prefix of ``text`` (not taken, order unchanged).

        Tokenizing the request as this entry's tokens plus the tokens of the rest of the text is
        what the chat REPL does each turn: re-tokenizing the whole text could split the reply's
        tokens differently and miss the cache."""
        with self._lock:
            best = None
            for entry in self._entries.values():
                if entry.text is not None and text.startswith(entry.text) and (
                        best is None or len(entry.text) > len(best.text)):
                    best = entry
            return best

    def take(self, tokens: list[int] | tuple[int, ...]) -> Parked | None:
        """Remove and return the entry with the longest token sequence that is a prefix of
        ``tokens`` and leaves at least one token to feed (the next token needs fresh logits)."""
        tokens = tuple(tokens)
        with self._lock:
            best = None
            for key, entry in self._entries.items():
                if entry.fed < len(tokens) and len(key) <= len(tokens) and tokens[: len(key)] == key and (
                        best is None or len(key) > len(best.tokens)):
                    best = entry
            if best is not None:
                del self._entries[best.tokens]
                self._bytes -= best.nbytes
            return best

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
