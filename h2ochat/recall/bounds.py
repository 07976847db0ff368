"""Quest's page digest on the device: per page and channel the min and max of its keys.

``PageBounds`` is a drop-in alternative to ``digests.KeyCodes`` for the selector "quest" (Quest,
ICML 2024): page p's score for queries q is the upper bound sum_c max(q_c low_c, q_c high_c) of any
q.k inside its box (``selectors.bound_score``), maximised over the M queries. A page still filling
(the newest) is bounded by the tokens it has.
"""

from __future__ import annotations

import torch

from .layout import FirstRows, append_slots, best_pages, frame_of, growable, held_pages, tensor_bytes, widened
from .selectors import bound_score, bounds

INF = float("inf")


class PageBounds(FirstRows):
    """Per (sequence, KV head) and frame the min (``low``) and max (``high``) per channel of the keys
    of the page the frame holds, in the cold store's layout (``layout``: page n // P of the n-th
    evicted token; a ring of ``frames`` pages under --cold-limit). ``low``/``high`` are
    [B, H, F + 1, D] in the keys' dtype; the last frame is a spill frame that takes the invalid
    entries of an append (never read). A frame is reset (+inf / -inf) by the first token of its page,
    so whatever it held before (a ring's older page, zeros after a row reset) never leaks in.

    Device bytes: 2 * D values per page of P tokens, 2 * D * 2 / P bytes per token in fp16 (D = 64,
    P = 16: 16 bytes per token), 2 / P of the page's fp16 keys; which page a frame holds is not
    stored: it follows from the count (``page_numbers``).
    """

    def __init__(self, batch: int, heads: int, head_dim: int, page: int, *, frames: int | None = None,
                 device=None, dtype=torch.float32, initial_pages: int = 4):
        self.page, self.frames = page, frames
        shape = (batch, heads, (frames or initial_pages) + 1, head_dim)  # + the spill frame
        self.low = torch.full(shape, INF, dtype=dtype, device=device)
        self.high = torch.full(shape, -INF, dtype=dtype, device=device)
        self.count = torch.zeros(batch, heads, dtype=torch.long, device=device)  # tokens ever appended
        if frames is None:
            growable(self.low)
            growable(self.high)

    @property
    def _stored(self) -> int:
        """Frames, less the spill frame."""
        return self.low.shape[2] - 1

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"low": self.low, "high": self.high, "count": self.count}

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` tokens per (sequence, head), decided on the host before a step."""
        pages = -(-needed // self.page)
        if self.frames is None and pages > self._stored:
            self.low = widened(self.low, pages, INF, spill=True)
            self.high = widened(self.high, pages, -INF, spill=True)

    def append(self, keys: torch.Tensor, token_index: torch.Tensor, *, reserve: bool = True) -> None:
        """The evicted keys [B, H, E, D] (token index -1: nothing evicted there), in eviction order.
        ``reserve=False``: the caller reserved room; else growing reads the count back. Fixed shapes:
        one reset scatter and one min and one max reduction per buffer."""
        valid = token_index >= 0
        added = valid.sum(dim=-1)
        if reserve:
            self.reserve(int((self.count + added).max()))
        slots = append_slots(valid, self.count)
        pages = slots // self.page
        # a page the same append pushes out of the ring (a long chunk) must not reach its frame
        first, _ = held_pages(self.count + added, self.page, self.frames)
        kept = valid & (pages >= first.unsqueeze(-1))
        frame = frame_of(pages, self.frames).masked_fill(~kept, self._stored)
        starts = frame.masked_fill(~(kept & (slots % self.page == 0)), self._stored)

        def spread(index):
            return index.unsqueeze(-1).expand(*index.shape, self.low.shape[-1])

        new = keys.detach().to(self.low.dtype)
        for buffer, empty, reduce in ((self.low, INF, "amin"), (self.high, -INF, "amax")):
            buffer.scatter_(2, spread(starts), empty)  # before the reduction: the frame's old page goes
            buffer.scatter_reduce_(2, spread(frame), new, reduce=reduce)
        self.count += added

    def rebuild(self, keys_by_slot: torch.Tensor) -> None:
        """After a re-numbering (RoPE): every held page's bounds again, from its keys at their new
        positions (``ColdStore.keys_by_slot`` [B, H, S, D]: token n in slot n, or n mod S in a ring),
        so pages are scored as the keys will be attended. Rare: once per re-numbering."""
        number = self.page_numbers()  # [B, H, F]
        held = number >= 0
        token = number.clamp(min=0).unsqueeze(-1) * self.page + torch.arange(self.page, device=number.device)
        present = held.unsqueeze(-1) & (token < self.count.view(*self.count.shape, 1, 1))  # [B, H, F, P]
        source = token % keys_by_slot.shape[2] if self.frames is not None else token
        source = source.masked_fill(~present, 0).flatten(2).to(keys_by_slot.device)
        dim = keys_by_slot.shape[-1]
        keys = keys_by_slot.gather(2, source.unsqueeze(-1).expand(*source.shape, dim))
        low, high, _ = bounds(keys.to(self.low.device).view(*present.shape, dim), present)
        where = held.unsqueeze(-1)
        for buffer, new in ((self.low, low), (self.high, high)):
            stored = buffer[:, :, :self._stored]
            stored.copy_(torch.where(where, new.to(buffer.dtype), stored))

    # -- which page each frame holds, and its score ----------------------------------------------
    def _scored_frames(self, upto: int | None) -> int:
        """The leading frames to score: all, or those ``upto`` tokens fill (at least one)."""
        if upto is None:
            return self._stored
        return min(max(-(-upto // self.page), 1), self._stored)

    def page_numbers(self, upto: int | None = None) -> torch.Tensor:
        """[B, H, F]: the absolute page number each frame holds now (-1: none): the latest page below
        the count's end that lives in that frame (held: a ring holds its last ``frames`` pages)."""
        _, end = held_pages(self.count, self.page, self.frames)
        last = (end - 1).unsqueeze(-1)
        frame = torch.arange(self._scored_frames(upto), device=self.count.device)
        number = last - (last - frame).remainder(self.frames or self._stored)
        return number.masked_fill(number < 0, -1)

    def _scores(self, queries: torch.Tensor, number: torch.Tensor) -> torch.Tensor:
        batch, heads, frames = number.shape

        def flat(t):
            return t.reshape(batch * heads, *t.shape[2:])

        bound = bound_score(flat(queries), flat(self.low[:, :, :frames]), flat(self.high[:, :, :frames]),
                            flat(number >= 0))  # [B * H, M, F]
        return bound.amax(dim=1).view(batch, heads, frames)

    def scores(self, queries: torch.Tensor, upto: int | None = None) -> torch.Tensor:
        """queries [B, H, M, D] -> [B, H, F]: each frame's bound (-inf: no page held). ``upto``: a host
        bound of the tokens appended (every row's count, or more): only the first F frames are scored."""
        return self._scores(queries, self.page_numbers(upto))

    def top_pages(self, queries: torch.Tensor, count: int, upto: int | None = None) -> torch.Tensor:
        """[B, H, k] absolute page numbers of the best ``count`` pages (-1 where fewer pages; k is
        fewer than ``count`` only where fewer frames are scored)."""
        number = self.page_numbers(upto)
        return best_pages(self._scores(queries, number), number, count)

    cap = None  # (one stage: every page scored on the device, no cap)
    pages_per_entry = 1

    def host_nbytes(self) -> int:
        return 0

    def nbytes(self) -> int:
        """The digest's device bytes: low and high per frame (the spill frame too) and the count."""
        return tensor_bytes(self.state_tensors().values())
