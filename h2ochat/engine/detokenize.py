"""Token ids to text as they are generated: pieces that join into exactly the text the ids spell.

Two things make this harder than decoding each id: a character may span several tokens (held
back until it is whole), and SentencePiece-style tokenizers (Llama-2, TinyLlama: Metaspace) drop
the leading space of the first token decoded, so a reply decoded on its own starts "Then" where
the text reads "the end. Then". Both are solved by decoding in context: the stream is seeded
with the last ids of the prompt, and a piece is what the new ids add to that context.

Fast tokenizers go through ``tokenizers.decoders.DecodeStream`` (incremental, in Rust); slow
ones and h2ochat's byte tokenizer through a window of recent ids decoded with and without the
newest one (linear in the text's length either way).
"""

from __future__ import annotations

from typing import Iterable, Sequence

CONTEXT_IDS = 6  # prompt ids that seed the stream: enough for a word or a multi-byte character


def _fast_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:  # pragma: no cover
        return None
    return backend if isinstance(backend, Tokenizer) else None


class TextStream:
    """Turns token ids into text pieces as they arrive, holding back incomplete characters.

    ``context``: the ids just before the first one pushed (the prompt's end), so the first piece
    joins the prompt as the whole text would (its leading space kept). ``text`` is what the pushed
    ids spell in that context.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, context: Sequence[int] = (),
                 fast: bool | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.pieces: list[str] = []
        context = [int(i) for i in list(context)[-CONTEXT_IDS:]]
        backend = _fast_backend(tokenizer) if fast is not False else None
        self._backend = backend
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._decoder = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # the window method: ids[prefix:read] were emitted and serve as context for what follows
        self._window = context
        self._prefix, self._read = 0, len(context)
        self._emitted_ids = 0  # ids whose text is in ``pieces``

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        self.ids.append(token_id)
        if self._backend is not None:
            piece = self._decoder.step(self._backend, token_id) or ""
        else:
            piece = self._push_window(token_id)
        if piece:
            self.pieces.append(piece)
            self._emitted_ids = len(self.ids)
        return piece

    def push_many(self, token_ids: Iterable[int]) -> str:
        """The text of several ids at once (a burst read back from the device in one go)."""
        return "".join(self.push(i) for i in token_ids)

    def _push_window(self, token_id: int) -> str:
        self._window.append(token_id)
        before = self._decode(self._window[self._prefix : self._read])
        after = self._decode(self._window[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._window)
        if self._prefix > 4 * CONTEXT_IDS:  # keep the window short: a long story stays linear
            drop = self._prefix - CONTEXT_IDS
            self._window = self._window[drop:]
            self._prefix, self._read = self._prefix - drop, self._read - drop
        return after[len(before) :]

    @property
    def text(self) -> str:
        """The text so far, including ids still held back (decoded as they are: an incomplete
        character shows as U+FFFD)."""
        held = self.ids[self._emitted_ids :]
        return "".join(self.pieces) + (self._decode(held) if held else "")


def decode_in_context(tokenizer, context: Sequence[int], ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """The text ``ids`` add after ``context`` (a reply after its prompt: " Then", not "Then")."""
    context, ids = list(context)[-CONTEXT_IDS:], list(ids)

    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=skip_special_tokens)

    before, whole = decode(context), decode(context + ids)
    return whole[len(before) :] if whole.startswith(before) else decode(ids)
