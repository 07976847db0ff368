"""The stories of one batch as they are written: each ``Row`` streams its text to its file (a file
that fails is given up, not the run), the tokens are read back from the device in bursts
(``read_in_bursts``), a story to continue is read through the cache chunk by chunk
(``read_long_text``), and ``tell`` is one continuation as text pieces."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from ..engine.detokenize import TextStream
from ..engine.generation import Sampling, Timing, inference_steps, prefill, stream


def tell(model, tokenizer, cache, input_ids, *, tokens: int, sampling: Sampling, stop_ids=frozenset(),
         prefill_chunk: int = 512, timing: Timing | None = None) -> Iterator[str]:
    """Text pieces of a continuation of ``input_ids`` [1, T], ``tokens`` long unless a stop id comes."""
    pieces = TextStream(tokenizer, context=input_ids[0].tolist())
    steps = stream(model, cache, input_ids, max_new_tokens=tokens, sampling=sampling, stop_ids=stop_ids,
                   prefill_chunk=prefill_chunk, timing=timing)
    for step in inference_steps(steps):
        yield pieces.push(step.tokens[0])


def read_in_bursts(steps, every: int) -> Iterator[list[list[int]]]:
    """The tokens of ``every`` steps at a time, read back from the device in one go: a list per step
    of the token of each row. The steps are queued on the device without waiting for each other."""
    held = []
    for step in steps:
        held.append(step.tokens)
        if len(held) == every:
            yield torch.stack(held).tolist()
            held.clear()
    if held:
        yield torch.stack(held).tolist()


class Row:
    """One story of the batch: its text stream, its file, its tokens."""

    def __init__(self, tokenizer, path: Path | None, keep_text: bool, context: list[int]):
        self.pieces = TextStream(tokenizer, context=context)
        self.path, self.file = path, None
        self.write_error: OSError | None = None  # the file stopped taking text (a full disk): see _write
        self.tokens: list[int] = []
        self.done = False
        self.text_parts: list[str] | None = [] if keep_text else None
        # the file already ends in whitespace: the continuation's own leading whitespace is dropped
        # (the model read the text without the trailing whitespace, and picks up after the last word)
        self.trim_leading = False

    def stop(self) -> None:
        """The row drew a stop id: it takes no more tokens."""
        self.done = True

    def open(self, opening: str) -> None:
        """A new story's file, the opening first."""
        if self.path is not None:
            self.file = self.path.open("w", encoding="utf-8")
            self._write(opening)

    def append_to(self, file, existing: str) -> None:
        """--continue: write after the story's last byte, into ``file`` (see ``appending``)."""
        self.file = file
        self.trim_leading = existing != existing.rstrip()

    def take(self, token: int) -> str:
        """Take the next token of the continuation; returns the text it adds to the story."""
        self.tokens.append(token)
        return self.add(self.pieces.push(token))

    def add(self, piece: str) -> str:
        """Take a piece of the continuation; returns the text it adds to the story."""
        if self.trim_leading and piece:
            piece = piece.lstrip()
            self.trim_leading = not piece
        if self.text_parts is not None:
            self.text_parts.append(piece)
        if self.file is not None and piece:
            self._write(piece.encode("utf-8") if "b" in self.file.mode else piece)
        return piece

    def _write(self, data) -> None:
        """Write and flush; a file that fails (no space left, a device gone) is given up, not the run:
        the story goes on to standard output and the error is told once at the end."""
        try:
            self.file.write(data)
            self.file.flush()
        except OSError as exc:
            self.write_error = exc
            self._give_up_file()

    def _give_up_file(self) -> None:
        try:
            if "b" not in self.file.mode:
                self.file.close()  # it tries to flush what it could not write, and fails again
        except OSError:
            pass
        self.file = None

    def close(self) -> None:
        """The file ends where the story does: no line break of the tool's own, which a later
        ``--continue`` would have to follow in mid-sentence (a file's bytes are never rewritten)."""
        if self.file is not None:
            try:
                self.file.flush()
                if "b" not in self.file.mode:  # a file of ours; an appended story's file belongs to `appending`
                    self.file.close()
            except OSError as exc:
                self.write_error = exc
                self._give_up_file()
            self.file = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts or [])


def read_long_text(model, cache, input_ids: torch.Tensor, keep: int, chunk: int, on_progress) -> torch.Tensor:
    """Feed all but the last ``keep`` tokens through the cache chunk by chunk (reporting progress);
    returns the tail, which ``stream`` reads (it seeds the repetition window with it)."""
    head = input_ids.shape[1] - keep
    with torch.inference_mode():  # positions may be re-numbered between chunks, in place
        for start in range(0, max(head, 0), chunk):
            prefill(model, cache, input_ids[:, start : min(start + chunk, head)], chunk=chunk)
            on_progress(min(start + chunk, head))
    return input_ids[:, max(head, 0) :]
