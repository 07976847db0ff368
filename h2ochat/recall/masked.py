"""The masked reference: a full cache whose attention admits exactly hot + recalled tokens.

The slow, obvious statement of the recall rule, used to measure selectors and as the test oracle of
the real two-tier cache. Every key stays in an ordinary transformers cache; per (layer, KV head) a
mask admits
- the hot tokens: what the eviction policy keeps with ``hot_slots`` slots (the new tokens enter,
  attention runs, the policy's scores are updated, then it evicts back down to ``hot_slots``), and
- the recalled tokens: the cold (evicted) tokens of the top ``recall_slots // page`` pages, chosen
  per (layer, KV head) by a selector from every query of the step (the group's query heads and, for
  a chunk, all its tokens; ``chunk_queries="last"``: its last token's only), and
- the step's new tokens, causally.
Pages group cold tokens by token index (page = index // P) or by eviction order (the n-th token
evicted from that head goes to page n // P). A recalled token is attended but stays cold unless
``reenter`` is set, in which case it competes for the hot slots with the score it earned.

Compact positions (``max_positions``): when the next tokens would pass the limit, the tokens held
anywhere (hot or recalled in the last step, any layer or head) are numbered by rank, order kept,
gaps closed (past ``span`` of them, the newest span // 2 keep consecutive numbers and the older ones
share the rest in proportion), a token held nowhere takes the number of the first held one after it,
and every stored key is rotated to its token's new position (``rotary``; OPT has none).

The rest (``rest=True``): the cold tokens neither recalled nor staged still count, one column per
unrecalled page: its weight is its tokens' exact share (the logsumexp of their logits), its value their
mean value. Only the values inside a page are approximated; with pages of one token this is the full
attention.

One sequence (batch 1). ``MaskedRecall.attach(model)`` switches the model to this attention; feed it
with ``forward``. ``stats`` holds, per layer, the share of the exact selector's top pages that the
chosen selector found (steps where every page fits in the recall slots are left out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from ..model_shape import cache_argument
from ..policies import Policy, get_policy, keep_priority
from ..rotary import rotate_keys
from .selectors import Selector, exact_score, get_selector, top_pages

NAME = "h2o_recall_masked"
_active: list["MaskedRecall"] = []


@dataclass
class _Layer:
    hot: torch.Tensor  # [H, T] bool
    cold: torch.Tensor  # [H, T] bool: evicted (recallable)
    scores: torch.Tensor  # [H, T] fp32, the policy's accumulated attention
    evicted_at: torch.Tensor  # [H, T] long: the token's number in its head's eviction order (-1: not evicted)
    importance: torch.Tensor  # [H, T] fp32: the score a token held when evicted
    evictions: torch.Tensor  # [H] long: tokens evicted so far per head
    recalled: torch.Tensor  # [H, T] bool: the tokens the last step recalled
    flushed: torch.Tensor | None = None  # [H] long: evicted tokens (in eviction order) past the staging page
    last_query: torch.Tensor | None = None  # [H, G, D]: the last step's last token's queries


@dataclass
class OverlapStats:
    found: list[float] = field(default_factory=list)  # per layer: summed share of exact top pages found
    steps: list[int] = field(default_factory=list)  # per layer: steps counted
    recalled_attention: list[float] = field(default_factory=list)  # per layer: attention mass on recalled tokens

    def per_layer(self) -> list[float | None]:
        return [f / s if s else None for f, s in zip(self.found, self.steps)]

    def mean(self) -> float | None:
        shares = [x for x in self.per_layer() if x is not None]
        return sum(shares) / len(shares) if shares else None


class MaskedRecall:
    def __init__(self, num_layers: int, policy: Policy | str, hot_slots: int, recall_slots: int, page: int,
                 selector: Selector | str | None = "exact", *, grouping: str = "index", reenter: bool = False,
                 measure: bool = True, chunk_queries: str = "all", max_positions: int | None = None,
                 rotary=None, staged: bool = False, every: int = 1, prefetch: bool = False, rest: bool = False):
        if grouping not in ("index", "eviction"):
            raise ValueError(f"grouping must be 'index' or 'eviction', got {grouping!r}")
        self.policy = get_policy(policy)
        self.budget = self.policy.split(hot_slots) if self.policy.evicts else None
        self.hot_slots, self.recall_slots, self.page = hot_slots, recall_slots, page
        self.selector = get_selector(selector) if isinstance(selector, str) else selector
        if chunk_queries not in ("all", "last"):
            raise ValueError(f"chunk_queries must be 'all' or 'last', got {chunk_queries!r}")
        self.grouping, self.reenter, self.measure = grouping, reenter, measure
        self.chunk_queries = chunk_queries  # which of a chunk's queries choose its pages
        self.layers: list[_Layer | None] = [None] * num_layers
        self.cache = DynamicCache()
        self.stats = OverlapStats([0.0] * num_layers, [0] * num_layers, [0.0] * num_layers)
        self.seen = 0
        self.max_positions, self.rotary = max_positions, rotary
        self.position: list[int] = []  # each token's position now
        self.next_position = 0
        self.compactions = 0
        # the real tier's schedule (``staging``, ``RecallTier.reserve``): the last recall page stages
        # the tokens decode steps evict (attended, not paged) until P decode steps passed or a chunk
        # comes; a decode step's pages are chosen with the previous step's queries every ``every`` steps
        # counted from the last flush
        self.staged, self.every = staged, every
        self.prefetch = prefetch  # a decode step's pages chosen with the previous step's queries (the compiled step's rule)
        self.rest = rest  # the unrecalled cold pages attended as one column each (the module's docstring)
        self.decode_steps = self.staging_steps = 0
        self.flush_now = self.select_now = self.has_query = False

    # -- driving the model ------------------------------------------------------------------------
    @staticmethod
    def attach(model) -> None:
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, _no_mask)
        model.set_attn_implementation(NAME)

    def forward(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed ``input_ids`` [1, Q]; returns the logits of the last token [1, V]."""
        q_len = input_ids.shape[1]
        if self.max_positions is not None and self.next_position + q_len > self.max_positions:
            self._renumber(min(self.max_positions - q_len, max(self.hot_slots, self.max_positions // 2)))
        positions = torch.arange(self.next_position, self.next_position + q_len).unsqueeze(0)
        self.flush_now = q_len > 1 or self.staging_steps >= self.page
        self.staging_steps = 0 if self.flush_now else self.staging_steps
        self.select_now = q_len > 1 or ((self.has_query or not self.prefetch) and self.staging_steps % self.every == 0)
        if q_len == 1:
            self.decode_steps += 1
            self.staging_steps += 1
        _active.append(self)
        try:
            with torch.inference_mode():
                out = model(input_ids=input_ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                            **{cache_argument(model): self.cache})
        finally:
            _active.pop()
        self.seen += q_len
        self.has_query = True
        self.position += positions[0].tolist()
        self.next_position += q_len
        return out.logits[:, -1]

    def _renumber(self, span: int) -> None:
        """Compact positions below ``span`` (the rule in the module's docstring), keys rotated."""
        held = set()
        for state in self.layers:
            if state is not None:
                held |= set(torch.nonzero((state.hot | state.recalled | self._staged(state)).any(dim=0))
                            .flatten().tolist())
        distinct = sorted({self.position[t] for t in held})
        count = len(distinct)
        width = min(count, span)
        newest = width // 2

        def renumbered(position):
            rank = min(sum(1 for p in distinct if p < position), count - 1)  # the first held at or after it
            return rank - (count - width) if rank >= count - newest else rank * (width - newest) // (count - newest)

        new = [renumbered(p) for p in self.position]
        if self.rotary is not None:
            delta = torch.tensor(new) - torch.tensor(self.position)
            with torch.inference_mode():  # the keys were made under it
                for layer in self.cache.layers:
                    rotate_keys(layer.keys, delta.expand(*layer.keys.shape[:2], -1), self.rotary)
        self.position, self.next_position = new, width
        self.compactions += 1

    # -- one layer's step ---------------------------------------------------------------------------
    def _staged(self, state: _Layer) -> torch.Tensor:
        """[H, T] bool: the evicted tokens still on the staging page (none without ``staged``)."""
        if not self.staged or state.flushed is None:
            return torch.zeros_like(state.cold) if not self.staged else state.cold.clone()
        return state.cold & (state.evicted_at >= state.flushed.unsqueeze(1))

    def _grow(self, layer_idx: int, heads: int, total: int, device) -> _Layer:
        state = self.layers[layer_idx]
        if state is None:
            empty = torch.zeros(heads, 0, device=device)
            state = _Layer(empty.bool(), empty.bool(), empty, empty.long(), empty, torch.zeros(heads, dtype=torch.long),
                           empty.bool())
        extra = total - state.hot.shape[1]
        if extra > 0:
            def widen(t, fill):
                return torch.cat([t, t.new_full((heads, extra), fill)], dim=1)
            state = _Layer(widen(state.hot, False), widen(state.cold, False), widen(state.scores, 0.0),
                           widen(state.evicted_at, -1), widen(state.importance, 0.0), state.evictions,
                           widen(state.recalled, False), state.flushed, state.last_query)
        self.layers[layer_idx] = state
        return state

    def paged(self, state: _Layer, keys: torch.Tensor):
        """The cold tokens of each head as pages (flushed ones with ``staged``): keys [H, N, P, D],
        valid, importance, token index."""
        heads, total, dim = keys.shape
        cold = state.cold & ~self._staged(state)
        if self.grouping == "index":
            number = torch.arange(total).expand(heads, total)
        else:
            number = state.evicted_at
        number = number.masked_fill(~cold, -1)
        pages = int(number.max().item()) // self.page + 1 if bool(cold.any()) else 0
        slots = pages * self.page
        # slot -> token, ``total`` marking an empty slot; tokens that are not cold land in a spare column
        flat = torch.full((heads, slots + 1), total, dtype=torch.long)
        where = number.clamp(min=0).masked_fill(number < 0, slots)
        flat.scatter_(1, where, torch.arange(total).expand(heads, total).contiguous())
        token = flat[:, :slots]  # [H, N*P]
        valid = token < total
        safe = token.clamp(max=max(total - 1, 0))
        paged_keys = keys.gather(1, safe.unsqueeze(-1).expand(heads, slots, dim)).view(heads, pages, self.page, dim)
        importance = state.importance.gather(1, safe).view(heads, pages, self.page)
        return paged_keys, valid.view(heads, pages, self.page), importance, token.view(heads, pages, self.page)

    def recalled(self, state: _Layer, keys: torch.Tensor, queries: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """[H, T] bool: the cold tokens of the pages the selector picks for these queries [H, M, D]."""
        heads, total, _ = keys.shape
        chosen = torch.zeros(heads, total, dtype=torch.bool)
        if not self.recall_slots or not bool((state.cold & ~self._staged(state)).any()):
            return chosen
        paged_keys, valid, importance, token = self.paged(state, keys)
        count = self.recall_slots // self.page - self.staged
        scores = self.selector.score(queries, self.selector.digest(paged_keys, valid, importance))
        picked = top_pages(scores, count)
        if self.measure:
            pages_held = int(valid.any(-1).sum(-1).min().item())
            if pages_held > count:
                exact = top_pages(exact_score(queries, (paged_keys, valid)), count)
                hits = (picked.unsqueeze(-1) == exact.unsqueeze(-2)).any(-1).float().mean().item()
                self.stats.found[layer_idx] += hits
                self.stats.steps[layer_idx] += 1
        for head in range(heads):
            pages = picked[head][picked[head] >= 0]
            tokens = token[head, pages].flatten()
            chosen[head, tokens[tokens < total]] = True
        return chosen

    def attend(self, module, query, key, value, scale) -> torch.Tensor:
        """query [1, Hq, Q, D], key/value [1, Hkv, T, D] (the whole text) -> [1, Q, Hq, D]."""
        layer_idx = module.layer_idx
        _, q_heads, q_len, dim = query.shape
        heads, total = key.shape[1], key.shape[2]
        group = q_heads // heads
        start = total - q_len
        state = self._grow(layer_idx, heads, total, key.device)
        keys, values = key[0], value[0]
        grouped = query[0].reshape(heads, group, q_len, dim)
        if self.policy.evicts:
            if self.flush_now:
                state.flushed = state.evictions.clone()
            choosing = grouped if self.chunk_queries == "all" else grouped[:, :, -1:]
            if self.staged and q_len == 1:  # on the cadence; before the step with the last step's queries (prefetch)
                choosing = (state.last_query if self.prefetch else grouped[:, :, -1]) if self.select_now else None
            recalled = state.recalled if choosing is None else self.recalled(state, keys, choosing.reshape(heads, -1, dim),
                                                                            layer_idx)
            state.recalled = recalled
            old = state.hot | recalled | self._staged(state)
        else:
            recalled = torch.zeros_like(state.hot)
            old = torch.ones_like(state.hot)
        old[:, start:] = False
        new_cols = torch.arange(total) >= start
        causal = (torch.arange(total).view(1, -1) - start) <= torch.arange(q_len).view(-1, 1)  # [Q, T]
        admit = old.unsqueeze(1) | (new_cols & causal).unsqueeze(0)  # [H, Q, T]
        raw = torch.einsum("hgqd,htd->hgqt", grouped.float(), keys.float()) * scale
        logits = raw.masked_fill(~admit.unsqueeze(1), float("-inf"))
        if self.rest and self.policy.evicts:
            rest_logit, rest_value = self.rest_column(state, raw, keys, values, recalled)
            probs = torch.cat([logits, rest_logit.unsqueeze(-1)], dim=-1).softmax(dim=-1)
            out = (torch.einsum("hgqt,htd->hgqd", probs[..., :total], values.float())
                   + probs[..., total:] * rest_value)
            probs = probs[..., :total]
        else:
            probs = logits.softmax(dim=-1)
            out = torch.einsum("hgqt,htd->hgqd", probs, values.float())
        out = out.to(query.dtype)
        if self.policy.evicts:
            mass = probs.sum(dim=(1, 2))  # [H, T]: attention each token received this step
            self.stats.recalled_attention[layer_idx] += float((mass * recalled).sum() / (group * q_len * heads))
            self._score_and_evict(state, mass, recalled, start, total)
            state.last_query = grouped[:, :, -1]
            if self.staged and q_len > 1:  # a chunk's drops go to the cold store at once
                state.flushed = state.evictions.clone()
        return out.reshape(q_heads, q_len, dim).transpose(0, 1).unsqueeze(0)

    def rest_column(self, state: _Layer, raw: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    recalled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The unrecalled cold pages as one column per query row: its logit (the logsumexp of their
        tokens' logits ``raw`` [H, G, Q, T]) and its value (the pages' mean values weighed by each page's
        share) -> [H, G, Q], [H, G, Q, D]. -inf and zeros where no such page is."""
        heads, group, q_len, total = raw.shape
        if not bool((state.cold & ~self._staged(state)).any()):
            return raw.new_full((heads, group, q_len), float("-inf")), raw.new_zeros(heads, group, q_len, values.shape[-1])
        _, valid, _, token = self.paged(state, keys)  # [H, N, P]
        safe = token.clamp(max=total - 1)
        member = valid & ~recalled.gather(1, safe.flatten(1)).view_as(valid)  # recalled pages hold none
        page_logits = raw.gather(3, safe.flatten(1).view(heads, 1, 1, -1).expand(heads, group, q_len, -1))
        page_logits = page_logits.view(heads, group, q_len, *valid.shape[1:])
        page_logits = page_logits.masked_fill(~member.view(heads, 1, 1, *valid.shape[1:]), float("-inf"))
        weight = page_logits.logsumexp(dim=-1)  # [H, G, Q, N]
        count = member.sum(-1, keepdim=True)  # [H, N, 1]
        page_values = values.float().gather(1, safe.flatten(1).unsqueeze(-1).expand(-1, -1, values.shape[-1]))
        page_values = (page_values.view(heads, *valid.shape[1:], -1) * member.unsqueeze(-1)).sum(2)
        mean = page_values / count.clamp(min=1)  # [H, N, D]
        logit = weight.logsumexp(dim=-1)  # [H, G, Q]
        share = (weight - logit.unsqueeze(-1)).exp().nan_to_num(0.0)  # -inf - -inf: no page at all
        return logit, torch.einsum("hgqn,hnd->hgqd", share, mean)

    def _score_and_evict(self, state: _Layer, mass, recalled, start, total) -> None:
        decay = self.policy.decay
        candidates = state.hot.clone()
        candidates[:, start:] = True
        if self.reenter:
            candidates |= recalled
        state.scores = torch.where(candidates, decay * state.scores + mass, state.scores)
        heads = candidates.shape[0]
        token_index = torch.arange(total).expand(heads, total).masked_fill(~candidates, -1)
        newest = torch.tensor([total - 1])
        priority = keep_priority(self.policy, self.budget, state.scores.unsqueeze(0), token_index.unsqueeze(0),
                                 newest)[0]
        keep_count = min(self.hot_slots, total)
        kept = torch.zeros_like(candidates)
        kept.scatter_(1, priority.topk(keep_count, dim=-1).indices, True)
        kept &= candidates
        dropped = candidates & ~kept & ~state.cold  # a recalled token that loses again is already cold
        order = dropped.long().cumsum(dim=1) - 1 + state.evictions.unsqueeze(1)
        state.evicted_at = torch.where(dropped, order, state.evicted_at)
        state.importance = torch.where(dropped, state.scores, state.importance)
        state.evictions = state.evictions + dropped.sum(dim=1)
        state.cold = (state.cold | candidates) & ~kept
        state.hot = kept


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _active[-1].attend(module, query, key, value, scale), None


def _no_mask(*args, **kwargs):
    return None

