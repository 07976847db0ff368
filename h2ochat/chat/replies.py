"""How a reply ends, in every command that generates one (run, generate, story, serve): the token ids
that end it (``stop_token_ids``), and, for a base model writing a plain transcript, the text held back
where it may be starting the user's next turn (``STOP_MARK``, ``ReplyText``).

Its own module because generate, story and the server use it without a conversation (conversation.py).
"""

from __future__ import annotations

from typing import Callable

# tokens that end an assistant turn in common chat templates, besides the tokenizer's eos
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def stop_token_ids(tokenizer, model=None) -> set[int]:
    """Ids that end a reply: eos, the generation config's eos list, end-of-turn markers. The one stopping
    rule of every command (run, generate, story --stop-at-eos), so a model that closes its turn with
    <|im_end|> stops everywhere, not only in the chat."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]:
        if value is not None:
            ids.add(int(value))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[name] for name in END_OF_TURN if name in vocab)
    return ids


STOP_MARK = "\nUser:"  # where a base model (plain transcript) starts writing the user's next turn


class ReplyText:
    """The reply's text as it streams: pieces go to ``on_piece``, except that with a ``stop_mark``
    the text that may be its start is held back until it is known not to be, and the mark itself
    (with what follows) is never shown or kept."""

    def __init__(self, stop_mark: str | None, on_piece: Callable[[str], None] | None):
        self.stop_mark, self.on_piece = stop_mark, on_piece
        self.streamed = ""  # all text so far
        self.shown = 0  # characters of it passed to on_piece
        self.stopped = False

    @property
    def text(self) -> str:
        return self.streamed[: self.shown] if self.stopped else self.streamed

    def _show(self, end: int) -> None:
        if end > self.shown and self.on_piece is not None:
            self.on_piece(self.streamed[self.shown : end])
        self.shown = max(self.shown, end)

    def add(self, piece: str) -> bool:
        """Take a piece; True when the stop mark has appeared (the reply ends before it)."""
        if not piece:
            return False
        self.streamed += piece
        if self.stop_mark is None:
            self._show(len(self.streamed))
            return False
        at = self.streamed.find(self.stop_mark, max(0, self.shown - len(self.stop_mark)))
        if at >= 0:
            self._show(at)
            self.stopped = True
            return True
        # hold back a tail that could still grow into the mark
        hold = next((k for k in range(min(len(self.stop_mark) - 1, len(self.streamed)), 0, -1)
                     if self.stop_mark.startswith(self.streamed[-k:])), 0)
        self._show(len(self.streamed) - hold)
        return False

    def finish(self) -> None:
        if not self.stopped:
            self._show(len(self.streamed))
