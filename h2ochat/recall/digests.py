"""Page digests kept on the device, appended as tokens are evicted, scored by the current queries.

``KeyCodes`` keeps each cold key as b-bit codes with a per-token scale and offset (``bits=None``:
the keys themselves, the exact selector), in the cold store's layout (``layout``: slot n of a
(sequence, head) is its n-th evicted token; a ring of ``frames`` pages under --cold-limit). The codes
are made from the evicted keys while they are still on the device, so the digest never needs the
host copy. Device bytes per token: D * bits / 8 + 8 (scale and offset in fp32) against D * 2 or 4
for the key itself.
"""

from __future__ import annotations

import torch

from .layout import Writes, growable, held_pages, widened
from .selectors import quantize, score_tokens_in_pages


class KeyCodes:
    def __init__(self, batch: int, heads: int, head_dim: int, page: int, bits: int | None, *,
                 frames: int | None = None, device=None, dtype=torch.float32, initial_pages: int = 4):
        if bits is not None and not 1 <= bits <= 8:
            raise ValueError(f"digest bits must be 1-8, got {bits}")
        self.page, self.bits, self.frames = page, bits, frames
        slots = (frames or initial_pages) * page
        code_dtype = torch.uint8 if bits is not None else dtype
        self.codes = torch.zeros(batch, heads, slots, head_dim, dtype=code_dtype, device=device)
        self.scale = torch.ones(batch, heads, slots, device=device)
        self.offset = torch.zeros(batch, heads, slots, device=device)
        # the absolute slot number (n-th evicted token) each ring slot holds, -1: none
        self.number = torch.full((batch, heads, slots), -1, dtype=torch.long, device=device)
        self.count = torch.zeros(batch, heads, dtype=torch.long, device=device)
        if frames is None:
            for name in ("codes", "scale", "offset", "number"):
                growable(getattr(self, name))

    def _grow(self, needed: int) -> None:
        for name in ("codes", "scale", "offset", "number"):
            setattr(self, name, widened(getattr(self, name), needed, -1 if name == "number" else 0))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in ("codes", "scale", "offset", "number", "count")}

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` tokens per (sequence, head), decided on the host before a step."""
        if self.frames is None and needed > self.number.shape[2]:
            self._grow(needed)

    def append(self, keys: torch.Tensor, token_index: torch.Tensor, *, reserve: bool = True) -> None:
        """The evicted keys [B, H, E, D] (token index -1: nothing evicted there), in eviction order.
        ``reserve=False``: the caller reserved room; else growing reads the count back."""
        valid = token_index >= 0
        added = valid.sum(dim=-1)
        if reserve:
            self.reserve(int((self.count + added).max()))
        writes = Writes.plan(valid, self.count, self.frames * self.page if self.frames is not None else None)
        if self.bits is None:
            writes.write(self.codes, keys)
        else:
            codes, scale, offset = quantize(keys, self.bits)
            writes.write(self.codes, codes)
            writes.write(self.scale, scale.squeeze(-1))
            writes.write(self.offset, offset.squeeze(-1))
        writes.write(self.number, writes.slots)
        self.count += added

    def rebuild(self, keys_by_slot: torch.Tensor) -> None:
        """After a re-numbering (RoPE): the digest of every held token again, from its key at its new
        position (``ColdStore.keys_by_slot``, the same slot numbering: slot n, or n mod the ring),
        so pages are scored as the keys will be attended. Rare: once per re-numbering."""
        held = (self.number >= 0).unsqueeze(-1)
        source = self.number.clamp(min=0).to(keys_by_slot.device)
        if self.frames is not None:
            source = source % keys_by_slot.shape[2]
        keys = keys_by_slot.gather(2, source.unsqueeze(-1).expand(*source.shape, keys_by_slot.shape[-1]))
        keys = keys.to(self.codes.device)
        if self.bits is None:
            self.codes.copy_(torch.where(held, keys.to(self.codes.dtype), self.codes))
            return
        codes, scale, offset = quantize(keys, self.bits)
        self.codes.copy_(torch.where(held, codes, self.codes))
        self.scale.copy_(torch.where(held[..., 0], scale.squeeze(-1), self.scale))
        self.offset.copy_(torch.where(held[..., 0], offset.squeeze(-1), self.offset))

    @property
    def valid(self) -> torch.Tensor:
        """[B, H, S] bool: ring slots holding a token of a page still held (an older page's leftovers
        in a frame a newer page has started are not)."""
        first, _ = held_pages(self.count, self.page, self.frames)
        return self.number >= (first * self.page).unsqueeze(-1)

    def page_numbers(self) -> torch.Tensor:
        """[B, H, F]: the absolute page number each frame holds now (-1: none)."""
        batch, heads, slots = self.number.shape
        latest = self.number.view(batch, heads, slots // self.page, self.page).amax(dim=-1)
        return torch.where(latest >= 0, latest // self.page, -1)

    def scores(self, queries: torch.Tensor) -> torch.Tensor:
        """queries [B, H, M, D] -> [B, H, F]: each stored page's best q.k (-inf: no token)."""
        batch, heads, slots, dim = self.codes.shape
        pages = slots // self.page

        def paged(t):
            return t.reshape(batch * heads, pages, self.page, *t.shape[3:])

        flat_q = queries.reshape(batch * heads, *queries.shape[2:])
        scale = paged(self.scale) if self.bits is not None else None
        offset = paged(self.offset) if self.bits is not None else None
        out = score_tokens_in_pages(flat_q, paged(self.codes), scale, offset, paged(self.valid))
        return out.view(batch, heads, pages)

    def top_pages(self, queries: torch.Tensor, count: int) -> torch.Tensor:
        """[B, H, k] absolute page numbers of the best ``count`` pages (-1 where fewer pages)."""
        from .selectors import top_pages

        scores = self.scores(queries)
        best = top_pages(scores, count)
        numbers = self.page_numbers()
        return numbers.gather(-1, best.clamp(min=0)).masked_fill(best < 0, -1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset, self.number))


