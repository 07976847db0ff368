"""Where evicted tokens land in an append-only paged store, shared by the cold store and the digests.

Each (sequence, KV head) appends its evicted tokens in eviction order: the n-th token it ever
evicted has slot number n and page n // P. With a limit the store is a ring of ``frames`` pages: page
p lives in frame p % frames, and writing the first token of page p drops page p - frames.
"""

from __future__ import annotations

import torch


def append_slots(valid: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Slot numbers [B, H, E] for the valid entries of ``valid`` [B, H, E] appended after ``count``
    [B, H] tokens, in order (-1 for invalid entries)."""
    offsets = valid.long().cumsum(dim=-1) - 1
    return (count.unsqueeze(-1) + offsets).masked_fill(~valid, -1)


def held_pages(count: torch.Tensor, page: int, frames: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """First and one-past-last page number [B, H] each (sequence, head) still holds."""
    end = (count + page - 1) // page
    first = (end - frames).clamp(min=0) if frames is not None else torch.zeros_like(end)
    return first, end


def frame_of(pages: torch.Tensor, frames: int | None) -> torch.Tensor:
    """Storage frame of absolute page numbers (the page itself without a limit)."""
    return pages % frames if frames is not None else pages
