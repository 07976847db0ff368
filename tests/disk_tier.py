"""A sketch of a second tier (issue 33): every token the policy evicts goes to files on disk, one per
archive call, under a directory. It is one module that plugs into ``H2OCache(tier=DiskSpec(...))``
through the tier port alone (``kv.tier_port.TierPort``: it imports nothing else of the cache and
reads nothing of the layer), as a disk tier under recall's host store would. It recalls nothing
(no slot columns of its own); ``tokens(row, head)`` reads back what it archived.
"""

from __future__ import annotations

from pathlib import Path

import torch

from h2ochat.kv.tier_port import TierPort


class DiskTier:
    """One layer's archive on disk."""

    columns = 0
    archives = True

    def __init__(self, directory: Path):
        self.directory = directory
        self.written = 0

    def allocate(self, port: TierPort, batch, heads, head_dim, value_dim, dtype, device) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.format = port.format

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def empty_value(self, name: str) -> int:
        return 0

    def reset(self) -> None:
        self.written = 0

    def reserve(self, port: TierPort, q_len: int, context) -> None:
        pass

    def before_attention(self, port: TierPort, query, new_valid, scale, context) -> None:
        return None

    def before_insert(self, port: TierPort) -> None:
        pass

    def _write(self, token_index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """[B, H, N] token indices (-1: nothing) with their float keys and values, as one file."""
        torch.save({"token_index": token_index.cpu(), "keys": keys.cpu(), "values": values.cpu()},
                   self.directory / f"{self.written:06d}.pt")
        self.written += 1

    def archive(self, port: TierPort, slot: torch.Tensor) -> None:
        victim = {name: tensor.unsqueeze(2) for name, tensor in port.victims(slot).items()}
        keys, values = self.format.decoded(victim, torch.float32)
        self._write(victim["token_index"], keys, values)

    def archive_dropped(self, port: TierPort, candidates, dropped: torch.Tensor) -> None:
        keys, values = self.format.decoded(candidates, torch.float32)
        self._write(candidates["token_index"].masked_fill(~dropped, -1), keys, values)

    def renumber(self, port: TierPort, renumbering, rotary) -> None:
        pass  # (the archive keeps the keys as they were encoded)

    def export_row(self, row: int, device, copy: bool = True) -> dict[str, torch.Tensor]:
        return {}

    def import_row(self, row: int, state, moved_from=None) -> None:
        pass

    def tokens(self, row: int, head: int) -> list[int]:
        """The token indices archived for (row, head), in the order they were archived."""
        found = []
        for path in sorted(self.directory.glob("*.pt")):
            index = torch.load(path)["token_index"][row, head]
            found.extend(int(t) for t in index if t >= 0)
        return found


class DiskSpec:
    """The disk tier of a whole cache: one directory per layer under ``root``."""

    columns = 0
    masks_inactive_rows = False  # every evicted token must reach the disk: every row takes every step
    row_prefixes = False

    def __init__(self, root: Path):
        self.root = root
        self.made = 0

    def make(self) -> DiskTier:
        self.made += 1
        return DiskTier(self.root / f"layer{self.made - 1}")

    def check(self, cache) -> None:
        if cache.grows:
            raise ValueError("the full policy evicts nothing: a disk tier needs an evicting policy")

    def compile_blocker(self, cache) -> str | None:
        return "the disk tier writes files"

    def record(self, cache) -> dict | None:
        return None

    def stats(self, cache):
        return None
