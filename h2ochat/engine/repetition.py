"""The tokens a repetition penalty looks at: the last N of the text, or all of it.

Penalising every token ever written pushes common words down more and more as a story grows,
until only rare tokens are left; llama.cpp and ollama bound the penalty to a recent window
(``repeat_last_n``, 64 by default). ``RecentTokens`` keeps, per sequence, a count per vocabulary
entry over the last N tokens and a ring of those N tokens, on the logits' device: each step takes
the token leaving the window off its count and adds the new one, O(batch) work whatever N is.
"""

from __future__ import annotations

import torch


class RecentTokens:
    """Counts per vocabulary entry over the last ``window`` tokens of each sequence (0 or -1: all).

    ``input_ids`` [B, T] is the text so far (``attention_mask`` marks padding, which never counts).
    A column past the vocabulary absorbs "no token" (padding, a window not yet full), so every
    update is one branch-free scatter.
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, vocab_size: int, window: int):
        batch, length = input_ids.shape
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        self.vocab_size = vocab_size
        self.window = max(window, 0)
        nothing = vocab_size
        if self.window:
            # the last `window` real tokens of each row, oldest first, "nothing" in front when short
            columns = torch.arange(length, device=input_ids.device).expand(batch, length)
            newest_first = torch.where(real, columns, -1).argsort(dim=1, descending=True, stable=True)
            newest_first = newest_first[:, : self.window]
            tokens = input_ids.gather(1, newest_first).masked_fill(~real.gather(1, newest_first), nothing)
            if tokens.shape[1] < self.window:
                tokens = torch.cat([tokens, tokens.new_full((batch, self.window - tokens.shape[1]), nothing)], dim=1)
            self.ring = tokens.flip(1).contiguous()
            self.next = 0  # ring column holding the oldest token, overwritten next
            counted = self.ring
        else:
            counted = input_ids.masked_fill(~real, nothing)
        self.counts = torch.zeros(batch, vocab_size + 1, dtype=torch.long, device=input_ids.device)
        self.counts.scatter_add_(1, counted, torch.ones_like(counted))
        self._ones = torch.ones(batch, 1, dtype=torch.long, device=input_ids.device)

    def push(self, tokens: torch.Tensor) -> None:
        """Append one token per sequence ([B]); the oldest leaves the window."""
        new = tokens.view(-1, 1).long()
        if self.window:
            column = self.ring[:, self.next : self.next + 1]
            self.counts.scatter_add_(1, column, -self._ones)
            column.copy_(new)
            self.next = (self.next + 1) % self.window
        self.counts.scatter_add_(1, new, self._ones)

    def mask(self) -> torch.Tensor:
        """[B, V] bool: the tokens inside the window."""
        return self.counts[:, : self.vocab_size] > 0
