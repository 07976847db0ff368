"""A block-level masked reference: what the plugin must compute, written the slow, obvious way.

One request through a transformers model with its whole cache (nothing is freed): every step,
before attention, the lowest-scored blocks outside the sinks and the recent window are marked
evicted until at most ``budget`` blocks remain; attention masks the evicted blocks' keys; the
softmax probabilities each block's keys receive (summed over layers, heads and the step's queries)
are added to its score. With recall, each KV head also attends, at every layer and step, the
evicted blocks whose keys give the step's last queries of its group the largest q.k (the best of any
key in the block: h2ochat's exact page selector, a block for a page), up to the recall slots; their
attention is added to no block's score; with the rest on, the last ``recall_queries`` queries of a
prompt chunk (a step of more than one token) attend every evicted block. Prompt chunks are the steps vLLM schedules (``chunk`` tokens each), then one
token per step. Written apart from the plugin (no vLLM, no ``choice``, no ``scores``), so that the
tests compare two implementations of the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ATTENTION_NAME = "h2ochat_block_reference"


@dataclass
class BlockRule:
    block_size: int
    budget: int  # blocks
    sinks: int  # first blocks, never evicted
    recent: int  # blocks counted back from the one the step's first token goes to, never evicted
    score_queries: int = 0  # 0: every query of a step adds its attention; k: only the step's last k
    score_every: int = 1  # a one-token step adds its attention only where its token's position is a multiple of this
    recall: int = 0  # blocks each KV head recalls from the evicted ones (besides ``budget``)
    recall_queries: int = 32  # a step's last queries that choose them
    rest: bool = False  # with recall, the last recall_queries queries of a longer step attend every evicted block


@dataclass
class _Step:
    evicted: set[int] = field(default_factory=set)
    scores: dict[int, float] = field(default_factory=dict)
    block_size: int = 1
    score_queries: int = 0
    recall: int = 0
    recall_queries: int = 32
    rest: bool = False


_CURRENT: list[_Step] = []


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention over the whole cache with the evicted blocks' keys masked; adds each block's
    received probability to the running step's scores."""
    step = _CURRENT[-1]
    batch, heads, n, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    key = key.repeat_interleave(heads // kv_heads, dim=1)
    value = value.repeat_interleave(heads // kv_heads, dim=1)
    logits = torch.matmul(query.float(), key.float().transpose(-1, -2)) * (scaling if scaling is not None else dim ** -0.5)
    places = torch.arange(length)
    own = torch.arange(length - n, length).view(-1, 1)
    hidden = (places.view(1, -1) > own).repeat(heads, 1, 1)  # [H, n, length]
    size = step.block_size
    for block in step.evicted:
        hidden[:, :, block * size: (block + 1) * size] = True
    for head, block in recalled(step, query, key[:, ::heads // kv_heads], heads // kv_heads):
        hidden[head, :, block * size: (block + 1) * size] = False
    if step.rest and step.recall and n > 1:  # the chunk's choosing queries attend every evicted block
        for block in step.evicted:
            hidden[:, -step.recall_queries:, block * size: (block + 1) * size] = False
    logits = logits.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    scoring = probs[:, :, -step.score_queries:] if step.score_queries else probs
    received = scoring.sum(dim=(0, 1, 2))
    for place in range(length):
        block = place // size
        if block not in step.evicted:
            step.scores[block] = step.scores.get(block, 0.0) + float(received[place])
    out = torch.matmul(probs, value.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), probs


def recalled(step: _Step, query: torch.Tensor, key: torch.Tensor, group: int) -> list[tuple[int, int]]:
    """(query head, evicted block) pairs to attend: per KV head, the ``step.recall`` evicted blocks whose best
    q.k, over the group's query heads and the step's last ``recall_queries`` queries, is largest."""
    cold = sorted(step.evicted)
    if not step.recall or not cold:
        return []
    pairs = []
    for kv_head in range(key.shape[1]):
        queries = query[0, kv_head * group: (kv_head + 1) * group, -step.recall_queries:].reshape(-1, query.shape[-1])
        best = [float((queries.float() @ key[0, kv_head, b * step.block_size: (b + 1) * step.block_size].float().T).max())
                for b in cold]
        chosen = sorted(range(len(cold)), key=lambda i: -best[i])[: step.recall]
        pairs += [(kv_head * group + g, cold[i]) for i in chosen for g in range(group)]
    return pairs


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)


def evict_before_step(rule: BlockRule, scores: dict[int, float], evicted: set[int], total: int, computed: int) -> None:
    """Mark blocks evicted until at most ``rule.budget`` of the ``ceil(total / block_size)`` blocks remain."""
    blocks = -(-total // rule.block_size)
    held = [b for b in range(blocks) if b not in evicted]
    first_unwritten = computed // rule.block_size
    candidates = [b for b in held if b >= rule.sinks and b <= first_unwritten - rule.recent]
    candidates.sort(key=lambda b: (scores.get(b, 0.0), b))
    for b in candidates[: max(0, len(held) - rule.budget)]:
        evicted.add(b)


@dataclass
class ReferenceRun:
    tokens: list[int]  # generated
    logits: list[torch.Tensor]  # [vocab] float32 before each generated token
    evicted: set[int]
    held_after_eviction: list[int]  # blocks held at each step, after that step's evictions


@torch.no_grad()
def generate(model, prompt: list[int], max_new: int, rule: BlockRule, chunk: int,
             forced: list[int] | None = None) -> ReferenceRun:
    """Greedy ``max_new`` tokens (or follow ``forced`` tokens, recording the logits the reference
    gives before each: a comparison that a near tie cannot derail)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    scores: dict[int, float] = {}
    evicted: set[int] = set()
    run = ReferenceRun([], [], evicted, [])
    computed, pending = 0, list(prompt)
    while len(run.tokens) < max_new:
        n = min(chunk, len(pending)) if computed < len(prompt) else 1
        feed, pending = pending[:n], pending[n:]
        total = computed + n
        evict_before_step(rule, scores, evicted, total, computed)
        run.held_after_eviction.append(sum(1 for b in range(-(-total // rule.block_size)) if b not in evicted))
        _CURRENT.append(_Step(evicted, {}, rule.block_size, rule.score_queries, rule.recall, rule.recall_queries,
                              rule.rest))
        try:
            out = model(input_ids=torch.tensor([feed]), position_ids=torch.arange(computed, total).view(1, -1),
                        past_key_values=cache, use_cache=True)
        finally:
            step = _CURRENT.pop()
        if n > 1 or computed % rule.score_every == 0:  # (``computed``: the one token's position)
            for block, got in step.scores.items():
                scores[block] = scores.get(block, 0.0) + got
        computed = total
        if computed >= len(prompt):
            last = out.logits[0, -1].float()
            token = int(last.argmax()) if forced is None else forced[len(run.tokens)]
            run.logits.append(last)
            run.tokens.append(token)
            pending = [token]
    return run
