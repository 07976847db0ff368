"""How far `generate` has read a long prompt, and what a Ctrl-C stopped.

A 2 MB prompt takes minutes to read before the first token: on a terminal a progress bar on
standard error shows it (off a terminal, a long prompt gets a line on standard error now and then);
standard output stays the reply's (or the JSON record's) alone. The count is read between prefill
chunks (``stream``'s ``should_stop`` hook), from a host counter: nothing is read back from the device.
"""

from __future__ import annotations

import time

from rich.console import Console

from .ui import TokenProgress, format_duration

LONG_PROMPT = 8192  # tokens: off a terminal, a prompt this long gets progress lines on standard error
LINE_EVERY_S = 10.0


def time_left(read: int, total: int, elapsed_s: float) -> float | None:
    """Seconds left to read ``total`` prompt tokens at the rate of the first ``read`` (None before
    there is a rate to go by)."""
    if read <= 0 or elapsed_s <= 0 or read >= total:
        return None
    return (total - read) * elapsed_s / read


def describe_reading(read: int, total: int, elapsed_s: float) -> str:
    """`reading the prompt: 12,288 of 200,031 tokens (410 tok/s, about 7m38s left)`."""
    text = f"reading the prompt: {read:,} of {total:,} tokens"
    left = time_left(read, total, elapsed_s)
    if left is not None:
        text += f" ({read / elapsed_s:,.0f} tok/s, about {format_duration(left)} left)"
    return text


def tokens_read(cache) -> int:
    """Prompt columns fed so far (a host count; padding included, none in a single prompt)."""
    return cache.layers[0].tokens_fed_with_padding if cache.layers else 0


class PromptProgress:
    """Reports the prompt's reading; ``should_stop`` is the hook ``stream`` asks between chunks."""

    def __init__(self, console: Console, cache, total: int):
        self.console, self.cache, self.total = console, cache, total
        self.bar = TokenProgress(console)
        self.lines = not self.bar.enabled and total >= LONG_PROMPT
        self.read = 0
        self.reading = True  # until the first decode step asks
        self._line_at = self._started = time.monotonic()

    def __enter__(self) -> "PromptProgress":
        self.bar.__enter__()
        self.bar.phase("reading the prompt", self.total)
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def should_stop(self) -> bool:
        """Never stops the run; notes how far the prompt has been read."""
        if self.reading:
            self.update(tokens_read(self.cache))
        return False

    def update(self, read: int) -> None:
        if read >= self.total:  # read whole: a decode step asks now
            self.reading, self.read = False, self.total
            self.bar.__exit__(None, None, None)  # the bar goes before the reply is written
            return
        self.read = read
        self.bar.update(read)
        if self.lines and time.monotonic() - self._line_at >= LINE_EVERY_S:
            self._line_at = time.monotonic()
            self.console.print(describe_reading(read, self.total, self._line_at - self._started), style="dim")

    def stopped(self, generated: int) -> str:
        """What a Ctrl-C stopped, in one line."""
        if self.reading:
            return f"stopped during the prompt, {self.read:,} of {self.total:,} tokens read; nothing generated"
        return f"stopped after {generated:,} generated token" + ("s" if generated != 1 else "")
