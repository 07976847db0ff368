"""Which blocks of one request leave: h2ochat's policy, applied to KV blocks instead of tokens.

A request's blocks are numbered by their place in the text (logical block j holds tokens
``j*block_size .. (j+1)*block_size - 1``). A block is a slot in h2ochat's terms: its score is the
attention its tokens received, summed over heads and queries; the sinks are the first blocks, the
recent window the blocks just before the ones this step writes. The blocks a step writes (from the
first token not yet computed on) are never candidates. h2ochat's ``keep_priority`` ranks them, as it
ranks tokens in h2ochat's own cache.
"""

from __future__ import annotations

import torch

from h2ochat.policies import Policy, SlotBudget, keep_priority


def blocks_to_evict(policy: Policy, budget: SlotBudget, scores: torch.Tensor, held: list[int],
                    first_unwritten: int) -> list[int]:
    """The logical blocks to evict, so that at most ``budget.slots`` of ``held`` remain, or as few
    as the protected ones allow. ``scores`` [n] float32 per logical block (n > max(held));
    ``first_unwritten`` is the block holding the first token this step computes (it and later
    blocks are being written)."""
    excess = len(held) - budget.slots
    if excess <= 0:
        return []
    index = torch.tensor(held, dtype=torch.long)
    # the window counts back from the block the step's first token goes to, as h2ochat's window
    # holds the token being generated; later blocks a prefill chunk writes (index > newest) fall in it
    newest = torch.tensor([first_unwritten])
    priority = keep_priority(policy, budget, scores[index].view(1, 1, -1).float(), index.view(1, 1, -1), newest)
    priority = priority.view(-1).tolist()  # +inf: protected (sinks, recent window, being written)
    # lowest priority first; among equals the older block goes (h2ochat's argmin takes the first)
    order = sorted((p, block) for p, block in zip(priority, held) if p != float("inf"))
    return sorted(block for _, block in order[:excess])
