"""Page selectors: a digest per page of cold keys, and a score per page from the current queries.

Every selector works on pages laid out as ``keys [H, N, P, D]`` with ``valid [H, N, P]`` (H KV heads,
N pages of P slots; a slot may be empty). ``digest(keys, valid, importance)`` returns what would be
kept on the device; ``score(queries [H, M, D], digest)`` returns ``[H, N]`` (higher = recall first;
pages with no valid slot get -inf). M is every query that reads the KV head: the group's query heads
times the step's new tokens, aggregated by max (a page matters when any query needs it).

``exact`` is the yardstick: the best q.k among the page's keys (its digest is the keys themselves).
``quest`` is Quest's per-channel min/max bound; ``quest_sub`` the same over sub-pages; ``quant``
keeps each key in b bits (packed, with a 16-bit per-token scale and offset: the device digest's
layout) and scores it like ``exact``; ``rot`` the same after a spreading rotation; ``reps`` keeps the
r keys that held the most attention when evicted (InfLLM's representative tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import h2ochat_kernels as kernels
# the per-token quantiser the quantised KV slots use too (unpacked codes, [..., 1] scale and offset)
from h2ochat_kernels.quant import level_codes as quantize
from h2ochat_kernels.quant import level_values as dequantize  # noqa: F401  (selectors.dequantize: the tests')
from h2ochat_kernels.rotation import spreading_rotation

from h2ochat_kernels.cpu import recall_ops as native
from .selector_names import AUTO, CODE_BITS

NEG_INF = float("-inf")


def score_pages(queries: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None,
                valid: torch.Tensor, page: int, bits: int | None = None,
                backend: kernels.Backend | None = None) -> torch.Tensor:
    """The best q.k per page of ``page`` consecutive slots: queries [B, H, M, D], codes [B, H, T, W]
    (``bits``-bit codes packed as ``kernels.pack_codes`` lays them out, keys ~ codes * scale + offset;
    the keys themselves when scale is None), valid [B, H, T] -> [B, H, T // page]. Codes, scale and
    offset may be views into bigger buffers (the leading slots of a store): nothing is copied. The
    Triton kernel on a GPU (through its op, so a compiled step holds it), its torch reference elsewhere:
    ``backend``'s choice (a cache layer's, made once), else the codes' device's; the keys themselves
    (no scale) on a CPU in bf16: the C kernel (``native.page_best``: the same sums, in another order)."""
    backend = backend if backend is not None else kernels.backend_for(codes.device)
    if scale is None and not backend.triton:  # the keys themselves on a CPU: the C kernel where it runs
        best = native.page_best(queries, codes, valid, page)
        if best is not None:
            return best
    return backend.page_scores(queries, codes, scale, offset, valid, page, bits)


def score_tokens_in_pages(queries: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
                          offset: torch.Tensor | None, valid: torch.Tensor, bits: int | None = None) -> torch.Tensor:
    """``score_pages`` for pages laid out as the selectors here keep them: queries [H, M, D], codes
    [H, N, P, W] -> [H, N]."""
    heads, pages, size = codes.shape[:3]

    def flat(t):
        return None if t is None else t.reshape(1, heads, pages * size, *t.shape[3:])

    return score_pages(queries.unsqueeze(0), flat(codes), flat(scale), flat(offset), flat(valid), size, bits)[0]


# -- exact --------------------------------------------------------------------------------------------
def exact_digest(keys, valid, importance=None):
    return keys, valid


def exact_score(queries, digest):
    keys, valid = digest
    return score_tokens_in_pages(queries, keys, None, None, valid)


# -- Quest: per-channel min/max bound -----------------------------------------------------------------
def bounds(keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel min and max over the valid slots of the last-but-one dim, and whether any is valid."""
    mask = valid.unsqueeze(-1)
    low = keys.float().masked_fill(~mask, float("inf")).amin(dim=-2)
    high = keys.float().masked_fill(~mask, NEG_INF).amax(dim=-2)
    any_valid = valid.any(dim=-1)
    return low.masked_fill(~any_valid.unsqueeze(-1), 0), high.masked_fill(~any_valid.unsqueeze(-1), 0), any_valid


def bound_score(queries: torch.Tensor, low: torch.Tensor, high: torch.Tensor, any_valid: torch.Tensor) -> torch.Tensor:
    """sum_c max(q_c low_c, q_c high_c), the largest q.k any key inside the box can reach.
    queries [H, M, D], low/high [H, N, D] -> [H, M, N]. As two matmuls, q.(low+high)/2 +
    |q|.(high-low)/2 (the same sum), so no [H, M, N, D] tensor: a prefill chunk has M in the thousands."""
    q = queries.float()
    low, high = low.float(), high.float()
    bound = q @ ((low + high) / 2).transpose(-1, -2) + q.abs() @ ((high - low) / 2).transpose(-1, -2)
    return bound.masked_fill(~any_valid.unsqueeze(1), NEG_INF)


def quest_digest(keys, valid, importance=None):
    return bounds(keys, valid)


def quest_score(queries, digest):
    return bound_score(queries, *digest).amax(dim=1)


def quest_sub_digest(sub: int):
    def digest(keys, valid, importance=None):
        heads, pages, size, dim = keys.shape
        return bounds(keys.view(heads, pages, size // sub, sub, dim), valid.view(heads, pages, size // sub, sub))
    return digest


def quest_sub_score(queries, digest):
    low, high, any_valid = digest  # [H, N, S, D], [H, N, S]
    heads, pages, subs, dim = low.shape
    score = bound_score(queries, low.reshape(heads, pages * subs, dim), high.reshape(heads, pages * subs, dim),
                        any_valid.reshape(heads, pages * subs))
    return score.view(heads, -1, pages, subs).amax(dim=(1, 3))


# -- low-bit keys ------------------------------------------------------------------------------------
def rotated(keys_or_queries: torch.Tensor) -> torch.Tensor:
    dim = keys_or_queries.shape[-1]
    return keys_or_queries.float() @ spreading_rotation(dim, keys_or_queries.device)


def packed_quantize(keys: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize`` as the device digest stores it: codes packed [..., W], scale and offset fp16 [...]."""
    codes, scale, offset = quantize(keys, bits, torch.float16)
    return kernels.pack_codes(codes, bits), scale.squeeze(-1), offset.squeeze(-1)


def rot_digest(bits: int):
    def digest(keys, valid, importance=None):
        return quant_digest(bits)(rotated(keys), valid)
    return digest


def rot_score(queries, digest):
    return quant_score(rotated(queries), digest)


def quant_digest(bits: int):
    def digest(keys, valid, importance=None):
        return packed_quantize(keys, bits), bits, valid
    return digest


def quant_score(queries, digest):
    (codes, scale, offset), bits, valid = digest
    return score_tokens_in_pages(queries, codes, scale, offset, valid, bits)


def quant_bytes_ratio(bits: int):
    """Packed codes plus a 16-bit scale and offset per token, against the token's 16-bit key."""
    return lambda page, dim: (kernels.packed_width(dim, bits) + 4) / (2 * dim)


# -- codes inside the page's box (Quest's min/max, then b bits per channel within it) ----------------
def box_digest(bits: int):
    """Per-channel quantisation within the page (KIVI quantises keys per channel): the page's min and
    max per channel (Quest's digest) plus b-bit codes of each key inside that box."""
    levels = (1 << bits) - 1

    def digest(keys, valid, importance=None):
        low, high, any_valid = bounds(keys, valid)
        step = ((high - low) / levels).clamp_min(1e-12).unsqueeze(2)  # [H, N, 1, D]
        codes = ((keys.float() - low.unsqueeze(2)) / step).round().clamp(0, levels).to(torch.uint8)
        return codes, step, low.unsqueeze(2), valid
    return digest


def box_score(queries, digest):
    codes, step, low, valid = digest
    return exact_score(queries, (codes.float() * step + low, valid))


# -- representative keys -----------------------------------------------------------------------------
def reps_digest(count: int):
    def digest(keys, valid, importance=None):
        weight = importance if importance is not None else keys.float().norm(dim=-1)
        weight = weight.masked_fill(~valid, NEG_INF)
        top = weight.topk(min(count, keys.shape[2]), dim=-1).indices  # [H, N, r]
        chosen = keys.gather(2, top.unsqueeze(-1).expand(*top.shape, keys.shape[-1]))
        return chosen, valid.gather(2, top)
    return digest


@dataclass(frozen=True)
class Selector:
    name: str
    digest: Callable  # (keys [H,N,P,D], valid [H,N,P], importance [H,N,P] | None) -> digest
    score: Callable  # (queries [H,M,D], digest) -> [H, N]
    bytes_ratio: Callable[[int, int], float]  # (page, head_dim) -> device bytes / the page's 16-bit keys


def _selectors() -> dict[str, Selector]:
    table = {
        "exact": Selector("exact", exact_digest, exact_score, lambda p, d: 1.0),
        "quest": Selector("quest", quest_digest, quest_score, lambda p, d: 2 / p),
    }
    for sub in (2, 4, 8):
        table[f"quest{sub}"] = Selector(f"quest{sub}", quest_sub_digest(sub), quest_sub_score,
                                        lambda p, d, s=sub: 2 / s)
    # every intN / rotN the two-tier cache accepts (selector_names: one list for both)
    for bits in CODE_BITS:
        table[f"int{bits}"] = Selector(f"int{bits}", quant_digest(bits), quant_score, quant_bytes_ratio(bits))
        table[f"rot{bits}"] = Selector(f"rot{bits}", rot_digest(bits), rot_score, quant_bytes_ratio(bits))
    for bits in (1, 2):
        # codes of b bits per channel plus the page's 16-bit min and max per channel
        table[f"box{bits}"] = Selector(f"box{bits}", box_digest(bits), box_score, lambda p, d, b=bits: 2 / p + b / 16)
    for count in (1, 2, 4):
        table[f"reps{count}"] = Selector(f"reps{count}", reps_digest(count), exact_score, lambda p, d, r=count: r / p)
    # the default: exact where the reference runs, in host memory beside the keys (selector_names.resolved_selector)
    table[AUTO] = Selector(AUTO, table["exact"].digest, table["exact"].score, lambda p, d: 0.0)
    return table


SELECTORS = _selectors()


def get_selector(name: str) -> Selector:
    try:
        return SELECTORS[name]
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; choose one of {', '.join(SELECTORS)}") from None


top_pages = kernels.top_pages  # [.., N] -> [.., k] page numbers, best first, -1 where fewer pages hold a token
