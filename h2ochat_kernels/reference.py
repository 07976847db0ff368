"""Plain-torch definitions of what every kernel in this package computes.

These functions are the semantics: the Triton kernels must equal them, and the CPU path of the
application runs them directly. Shapes follow one convention throughout:

    B  sequences in the batch        Hkv  KV heads          G  query heads per KV head (GQA group)
    S  cache slots scanned            Q    new tokens this step (1 when decoding)      D  head dim

A slot is valid when its ``slot_token_index`` is >= 0; empty slots and padding hold -1.
"""

from __future__ import annotations

import torch

from . import blocked_chunk
from . import quant as _quant
from .attention_rows import MASKED as _MASKED
from .attention_rows import empty_slot_bias
from .attention_rows import f32 as _f32
from .attention_rows import new_key_mask as _new_key_mask
from .attention_rows import query_row_weights as _query_row_weights
from .attention_rows import softmax_beside_rest as _softmax_beside_rest
from .attention_rows import with_rest as _with_rest


def attend_with_scores(
    query: torch.Tensor,
    cache_keys: torch.Tensor,
    cache_values: torch.Tensor,
    slot_token_index: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    new_valid: torch.Tensor | None,
    scale: float,
    scores: torch.Tensor,
    decay: float | torch.Tensor = 1.0,
    quant: _quant.QuantSlots | None = None,
    rest: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of Q new queries over S cached slots plus the Q new tokens, with H2O scoring.

    query            [B, Hkv, G, Q, D]
    cache_keys/values [B, Hkv, S, D]     (may be a strided view of a larger slot buffer)
    slot_token_index [B, Hkv, S] int     (< 0: slot holds nothing attendable)
    new_keys/values  [B, Hkv, Q, D]
    new_valid        [B, Q] bool or None (False: padding token; None: all real)
    scores           [B, Hkv, S] float32, updated in place: += attention probability each slot
                     received, summed over the G query heads and the real query rows.
    decay            float, or [B] float32 per sequence: the score update is S <- decay * S + a_t
                     per real token t, as if the Q tokens were fed one at a time. So the old scores
                     are multiplied by decay ** (real rows this step) and query row q's
                     probabilities weigh decay ** (real rows after q). 1 = the paper's plain sum,
                     0 = the last real row's attention only.
    quant            None, or ``quant.QuantSlots``: the slots are quantised, cache_keys/values are
                     their codes [B, Hkv, S, W] uint8, attended as code * scale + offset (an fp32
                     query: the scale and offset applied to the logits and the probabilities,
                     ``_slot_logits``; a 16-bit one: the slots dequantised to its dtype); the new
                     tokens stay at full precision (the token a step adds is attended as it is, and
                     quantised only when the cache writes it).
    rest             None, or one more column per query row that no slot holds (a recall tier's cold
                     pages left unrecalled, ``recall.rest``): (logit [B, Hkv, G, Q] fp32, already
                     scaled; -inf for none, value [B, Hkv, G, Q, D]). It shares the softmax and adds
                     its share of its value to the output; it is no slot, so no score receives it.

    New tokens attend causally among themselves. Padding keys receive no attention; padding query
    rows add nothing to any score (and do not decay it: a decode step's row left out by an active
    mask comes here as a padding token, ``H2OLayer.attend``). Returns (output [B, Hkv, G, Q, D] in query's dtype,
    new_scores [B, Hkv, Q] float32: the same column sums for the new tokens).
    """
    batch, kv_heads, group, q_len, head_dim = query.shape
    native = _multiplies_bf16_slots(query, cache_keys, quant, q_len)
    if quant is not None and query.dtype != torch.float32:
        # in the query's dtype: what an unquantised cache of the model's dtype would hold (and what
        # the kernels' 16-bit dots take)
        cache_keys, cache_values = _quant.dequantized_slots(cache_keys, cache_values, quant, query.dtype)
        quant = None
    weights = row_weights(new_valid, batch, q_len, decay, query.device)  # [B, Q] or None
    _decay_scores(scores, new_valid, batch, q_len, decay, query.device)
    if quant is None and blocked_chunk.runs_blocked(q_len, query.device):
        out, received = blocked_chunk.attend_blocked(query, cache_keys, cache_values, slot_token_index, new_keys,
                                                     new_values, new_valid, weights, scale, rest=rest)
        scores += received[..., :cache_keys.shape[2]]
        return (out if out.dtype == query.dtype else out.to(query.dtype)), received[..., cache_keys.shape[2]:]
    # the scale goes on the queries once, not on both logit blocks
    rows = _f32(query.reshape(batch, kv_heads, group * q_len, head_dim)) * scale
    empty = empty_slot_bias(slot_token_index).unsqueeze(2)  # (an empty slot's logit: _MASKED added)
    if native:
        cache_keys, cache_values = _contiguous(cache_keys), _contiguous(cache_values)
        # (the scale and the mask in one op, into fp32: bias + scale * logits)
        cache_logits = torch.add(empty, torch.matmul(query.reshape(rows.shape), cache_keys.transpose(-1, -2)),
                                 alpha=scale)
    else:
        cache_logits = _slot_logits(rows, cache_keys, quant)
        cache_logits += empty
    new_logits = torch.matmul(rows, _f32(new_keys).transpose(-1, -2))
    if q_len > 1 or new_valid is not None:  # one real new token sees itself: nothing to mask
        new_logits = new_logits.view(batch, kv_heads, group, q_len, q_len)
        new_logits = new_logits.masked_fill(~_new_key_mask(new_valid, batch, q_len, query.device), _MASKED)
        new_logits = new_logits.view(batch, kv_heads, group * q_len, q_len)

    probs, rest_part = _softmax_beside_rest([cache_logits, new_logits], rest, batch, kv_heads)
    slots = cache_keys.shape[2]
    cache_probs, new_probs = probs[..., :slots], probs[..., slots:]
    if native:
        out = torch.matmul(cache_probs.to(cache_values.dtype), cache_values).float()
    else:
        out = _slot_output(cache_probs, cache_values, quant)
    out = _with_rest(out + torch.matmul(new_probs, _f32(new_values)), rest_part)

    if weights is not None:
        rows_w = _query_row_weights(weights, group)
        cache_probs, new_probs = cache_probs * rows_w, new_probs * rows_w
    scores += cache_probs.sum(dim=2)
    new_scores = new_probs.sum(dim=2)
    out = out.view(batch, kv_heads, group, q_len, head_dim)
    return (out if out.dtype == query.dtype else out.to(query.dtype)), new_scores


# a CPU decode step over bf16 slots attends every slot column once this share of them is in use
FULL_WIDTH_SHARE = 0.7


def attends_every_column(q_len: int, in_use: int, columns: int, slots: torch.Tensor) -> bool:
    """Whether a step of ``q_len`` tokens over ``in_use`` of ``columns`` slot columns (``slots``: a slot
    tensor of the layer) reads all of them, the empty ones masked, instead of the first ``in_use``: a
    CPU decode step over bf16 slots (multiplied as they are: ``_multiplies_bf16_slots``; fp16 slots are
    converted to fp32, column by column read), once 70% are in use. The view of the first W columns must be
    copied for the batched product (``_contiguous``); the whole block is read as it is. Measured
    (``benchmarks/results_attention_width.json``, one thread, bf16, 1,638 columns, the whole
    ``attend_with_scores``): at 8 rows all columns take 1.31 ms whatever is in use, the copy 1.23 ms at
    1,100 in use and 1.76 ms at 1,500 (crossing near 70%); at 1 row they cross near 60%."""
    return (q_len == 1 and slots.device.type == "cpu" and slots.dtype == torch.bfloat16
            and in_use >= FULL_WIDTH_SHARE * columns)


def _multiplies_bf16_slots(query, cache_keys, quant, q_len: int) -> bool:
    """A CPU decode step of a bf16 model over bf16 slots multiplies the slots as they are (the two
    products over the slots in bf16 with fp32 accumulation, their results rounded to bf16: what a
    bf16 model's own attention does), not converted to fp32 first: the conversion copies every slot
    every step, and the two products take 2.4x less CPU (8 rows x 1,638 slots, one thread,
    ``benchmarks/results_attention_layout.json``). The softmax and the scores stay fp32."""
    return (quant is None and q_len == 1 and query.device.type == "cpu" and query.dtype == torch.bfloat16
            and cache_keys.dtype == torch.bfloat16)


def _contiguous(slots: torch.Tensor) -> torch.Tensor:
    """``slots`` as one block: the first W of C slot columns (a cache not full yet) are a view whose batch
    stride is C, and torch's CPU bf16 batched product takes a slow path for such a view: 3-9x the time of
    a copy and a product on the copy (8 rows, 400-1,500 of 1,638 slots, one thread; the fp32 product
    does not care)."""
    return slots.contiguous()  # (no copy when it already is one)


def _decay_scores(scores: torch.Tensor, new_valid, batch: int, q_len: int, decay, device) -> None:
    """The old scores' part of ``S <- decay * S + a``, in place (nothing at decay 1)."""
    if _is_one(decay):
        return
    if new_valid is None and not isinstance(decay, torch.Tensor):
        scores *= float(decay) ** q_len  # one op: every row decays alike
    else:
        scores *= old_score_factor(new_valid, batch, q_len, decay, device).view(batch, 1, 1)


def _slot_logits(rows: torch.Tensor, keys: torch.Tensor, quant) -> torch.Tensor:
    """rows [B, Hkv, M, D] fp32 . the slots' keys -> [B, Hkv, M, S]. Quantised keys (fp32 rows):
    q . (c * s + o) = s * (q . c) + o * sum(q), so the codes are converted once and never expanded
    to keys (a [S, D] multiply and add per layer saved: on the CPU each costs more than the matmul)."""
    if quant is None:
        return torch.matmul(rows, _f32(keys).transpose(-1, -2))
    codes = _quant.unpacked(keys, quant.bits, quant.key_dim).float()
    dots = torch.matmul(rows, codes.transpose(-1, -2))
    return torch.addcmul(rows.sum(-1, keepdim=True) * quant.key_offset.unsqueeze(2), dots,
                         quant.key_scale.unsqueeze(2))


def _slot_output(probs: torch.Tensor, values: torch.Tensor, quant) -> torch.Tensor:
    """probs [B, Hkv, M, S] @ the slots' values -> [B, Hkv, M, D]; quantised values:
    sum_s p_s (c_s * v_s + o_s) = (p * scale) @ c + p @ offset."""
    if quant is None:
        return torch.matmul(probs, _f32(values))
    codes = _quant.unpacked(values, quant.bits, quant.value_dim).float()
    return (torch.matmul(probs * quant.value_scale.unsqueeze(2), codes)
            + torch.matmul(probs, quant.value_offset.unsqueeze(-1)))


def _is_one(decay) -> bool:
    return not isinstance(decay, torch.Tensor) and float(decay) == 1.0


def _decay_per_row(decay, batch: int, device) -> torch.Tensor:
    if isinstance(decay, torch.Tensor):
        return decay.to(device=device, dtype=torch.float32).reshape(-1).expand(batch)
    return torch.full((batch,), float(decay), dtype=torch.float32, device=device)


def row_weights(new_valid: torch.Tensor | None, batch: int, q_len: int, decay, device) -> torch.Tensor | None:
    """[B, Q] float32 weight of each query row's probabilities in the scores: 0 for padding rows,
    decay ** (real rows after it) for real ones. None when every weight is 1."""
    if new_valid is None and (q_len == 1 or _is_one(decay)):
        return None  # a single real row always weighs 1: decode steps skip the weighting
    real = torch.ones(batch, q_len, dtype=torch.bool, device=device) if new_valid is None else new_valid
    if _is_one(decay):
        return real.float()
    later = real.flip(1).long().cumsum(1).flip(1) - real.long()  # real rows strictly after q
    # pow(0, 0) = 1: with decay 0 the last real row keeps its full weight
    weights = torch.pow(_decay_per_row(decay, batch, device).view(batch, 1), later.float())
    return weights * real


def old_score_factor(new_valid: torch.Tensor | None, batch: int, q_len: int, decay, device) -> torch.Tensor:
    """[B] float32: what the cached scores are multiplied by this step, decay ** (real rows)."""
    real = torch.full((batch,), q_len, device=device) if new_valid is None else new_valid.sum(1)
    return torch.pow(_decay_per_row(decay, batch, device), real.float())


def gather_slots(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor.gather(2, index)``, for every slot dtype: torch has no gather for float8 (the fp8
    slots), so a one-byte float is gathered as its bytes (a gather moves bits, it computes nothing)."""
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        return tensor.view(torch.uint8).gather(2, index).view(tensor.dtype)
    return tensor.gather(2, index)


def lowest_slots(priority: torch.Tensor) -> torch.Tensor:
    """[B, Hkv] the slot each (sequence, KV head) evicts: the lowest priority, ties to the lowest slot
    index (torch's argmin and the eviction kernel choose alike). The one place a victim is chosen:
    a caller that must see the victim before it is overwritten (a cold tier) asks this, then
    ``write_slots`` writes exactly there."""
    return priority.argmin(dim=-1)


def slot_coordinates(batch: int, kv_heads: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (sequence, head) index tensors that address one slot per (sequence, KV head) with
    ``write_slots``; a layer makes them once and passes them on every step (two ops saved)."""
    return (torch.arange(batch, device=device).view(-1, 1), torch.arange(kv_heads, device=device).view(1, -1))


def write_slots(slot, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                new_token_index, new_position, value_norm=None, new_value_norm=None, active=None, *,
                coordinates=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Overwrite slot ``slot`` [B, Hkv] of each (sequence, KV head) with the new token, in place
    (``evict_and_insert``'s write, for a victim already chosen). The writes are ``index_put_``:
    fewer ops than gather/scatter, and torch.compile keeps them in place where it would copy a whole
    scattered buffer. ``coordinates``: ``slot_coordinates(B, Hkv)``, made here when not given.
    Returns what ``evict_and_insert`` returns."""
    batch, kv_heads = slot.shape
    rows, heads = coordinates if coordinates is not None else slot_coordinates(batch, kv_heads, slot.device)
    where = (rows, heads, slot)
    dropped, dropped_score = slot_token_index[where], scores[where]
    writes = [(keys, new_key[:, :, 0]), (values, new_value[:, :, 0]), (scores, new_score),
              (slot_token_index, new_token_index.view(-1, 1)),  # one per sequence, for all its heads
              (slot_position, new_position.view(-1, 1))]
    if value_norm is not None:
        writes.append((value_norm, new_value_norm))
    for buffer, new in writes:
        new = new if new.dtype == buffer.dtype else new.to(buffer.dtype)
        if active is not None:  # an inactive row writes its slot's own content back: the same bits
            new = torch.where(active.view(-1, *([1] * (new.dim() - 1))), new, buffer[where])
        buffer.index_put_(where, new)
    if active is not None:
        dropped = dropped.masked_fill(~active.view(-1, 1), -1)
        dropped_score = dropped_score.masked_fill(~active.view(-1, 1), 0.0)
    return dropped, dropped_score


def evict_and_insert(
    priority: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    slot_token_index: torch.Tensor,
    slot_position: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    new_score: torch.Tensor,
    new_token_index: torch.Tensor,
    new_position: torch.Tensor,
    value_norm: torch.Tensor | None = None,
    new_value_norm: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
    *,
    coordinates=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-step eviction: per (sequence, KV head) overwrite the lowest-priority slot in place.

    priority          [B, Hkv, S] float: higher = keep. Callers give -inf to empty/padding slots (so
                      they go first) and +inf to protected ones (recent window, sinks).
    keys/values       [B, Hkv, S, D]; scores [B, Hkv, S] float32;
    slot_token_index, slot_position [B, Hkv, S] int64
    new_key/new_value [B, Hkv, 1, D]; new_score [B, Hkv] float32;
    new_token_index, new_position [B] int64 (the same for every head of a sequence)
    value_norm        [B, Hkv, S] float32 or None: ||v|| per slot, kept beside the score when the
                      policy ranks by it; new_value_norm [B, Hkv] is the new token's

    active            [B] bool or None (None: every row): a row that is not active writes nothing
                      (a finished row of a burst of decode steps) and reports nothing dropped

    Ties go to the lowest slot index. Returns the token index each (sequence, head) dropped
    [B, Hkv] (-1 where the chosen slot held nothing, or the row is not active) and the score it held
    [B, Hkv] float32 (0 for a row that is not active). This is what the CPU runs (``H2OLayer``'s
    torch route calls it directly), so the kernel tests that hold Triton to it cover the CPU path.
    """
    return write_slots(lowest_slots(priority), keys, values, scores, slot_token_index, slot_position, new_key,
                       new_value, new_score, new_token_index, new_position, value_norm, new_value_norm, active,
                       coordinates=coordinates)


# -- which slot goes: the policy rules every caller shares ------------------------------------------

def _per_row(value, like: torch.Tensor) -> torch.Tensor | int:
    """An int, or a [B] tensor shaped to broadcast against [B, Hkv, S]."""
    return value.to(like.device).view(-1, 1, 1) if isinstance(value, torch.Tensor) else value


def protected_slots(slot_token_index: torch.Tensor, newest: torch.Tensor, recent, sinks) -> torch.Tensor:
    """[B, Hkv, S] bool: the slots no policy may evict: the ``recent`` most recent tokens (token
    index > newest - recent, ``newest`` [B] being each sequence's newest token, counted in) and the
    first ``sinks`` tokens of the text. ``recent`` and ``sinks`` are ints or [B] tensors."""
    newest = newest.to(slot_token_index.device).view(-1, 1, 1)
    recent_window = slot_token_index > newest - _per_row(recent, slot_token_index)
    if isinstance(sinks, int) and sinks == 0:
        return recent_window
    sink = (slot_token_index >= 0) & (slot_token_index < _per_row(sinks, slot_token_index))
    return recent_window | sink


def token_age(slot_token_index: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, S] float32: how many query tokens have seen each slot's token (itself included)."""
    age = newest.to(slot_token_index.device).view(-1, 1, 1) - slot_token_index + 1
    return age.clamp(min=1).to(torch.float32)


def slot_rank(scores, slot_token_index, newest, value_norm=None, *, oldest_first=False, by_age=False,
              value_eps=None) -> torch.Tensor:
    """[B, Hkv, S] float32 merit of each slot (higher = keep), the ranks the built-in policies use:
    oldest_first: the token index (the oldest goes first); otherwise the score, divided by the
    token's age when ``by_age`` (mean attention per step seen), times (rank + value_eps) * ||v||
    when ``value_eps`` is not None (a token with a large value moves the output more)."""
    if oldest_first:
        return slot_token_index.to(torch.float32)
    rank = scores
    if by_age:
        rank = rank / token_age(slot_token_index, newest)
    if value_eps is not None:
        rank = (rank + value_eps) * value_norm
    return rank


def keep_priority(rank, slot_token_index, newest, recent, sinks) -> torch.Tensor:
    """Priority [B, Hkv, S] (higher = keep) from a rank: +inf for protected slots, -inf for empty
    and padding slots (they go first), the rank elsewhere."""
    priority = rank.masked_fill(protected_slots(slot_token_index, newest, recent, sinks), float("inf"))
    return priority.masked_fill(slot_token_index < 0, float("-inf"))


def evict_by_policy(keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                    new_token_index, new_position, value_norm=None, new_value_norm=None, active=None, *, recent,
                    sinks, oldest_first=False, by_age=False, value_eps=None, coordinates=None):
    """``evict_and_insert`` with the priority computed from the policy's parameters (the work the
    fused eviction kernel does in one launch). ``new_token_index`` is the newest token (for a row
    that is not active, whatever it holds: the row writes nothing)."""
    rank = slot_rank(scores, slot_token_index, new_token_index, value_norm, oldest_first=oldest_first,
                     by_age=by_age, value_eps=value_eps)
    priority = keep_priority(rank, slot_token_index, new_token_index, recent, sinks)
    return evict_and_insert(priority, keys, values, scores, slot_token_index, slot_position, new_key, new_value,
                            new_score, new_token_index, new_position, value_norm, new_value_norm, active,
                            coordinates=coordinates)
