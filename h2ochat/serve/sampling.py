"""The next token of every row of a decode step in one call, on the logits' device.

Each row samples with its own settings, its own random stream and its own repetition window
(``SampledRow``: a ``Choice``). Rows that share their settings have their distribution made
together (``generation.token_probs``: penalty, temperature, top-k, top-p); then every sampling row of
the step draws at once by the exponential race, as gpt-fast and vLLM sample: the token is
argmax(p / E) with E ~ Exponential(1) per vocabulary entry, which picks token i with probability
p_i (E_i / p_i is exponential of rate p_i, and the smallest of such draws is i's with that
probability). Each row's E comes from its own generator, V draws a step whatever the batch holds, so
a seeded request draws the same tokens alone or beside any neighbours. Greedy rows take the argmax.
The tokens of all rows come back to the host in one read.

A row whose sampling fails gets its exception instead of a token and the others are sampled as if
it were not there: a generator or window on another device than the logits (the sampler refuses it
with a clear error, where torch would raise or, on some devices, silently run), logits holding NaN
or +inf (flagged on the device), or anything else making its distribution raises (the group is
then made again row by row: nothing random was drawn yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..engine.generation import Sampling, sample, token_probs
from ..engine.repetition import RecentTokens


class SampledRow(Protocol):
    """What a row samples with; its generator and window are made on the logits' device when first asked."""

    sampling: Sampling

    def generator_on(self, device: torch.device) -> torch.Generator: ...

    def window_on(self, device: torch.device, vocab: int) -> RecentTokens: ...

    # optional: what the row adds to its logits first ([V] fp32: logit_bias and OpenAI's penalties), or None
    # def logit_offsets_on(self, device: torch.device, vocab: int) -> torch.Tensor | None: ...


class SamplingDeviceError(ValueError):
    """A row's generator or repetition window is not on the logits' device."""


@dataclass
class _Draw:
    index: int  # the row in the logits
    sampling: Sampling
    generator: torch.Generator | None  # None for a greedy row (it draws nothing)
    window: RecentTokens | None  # None without a repetition penalty

    @property
    def key(self) -> tuple:
        """Rows with equal keys have their distribution made together."""
        penalty = self.sampling.repetition_penalty if self.window is not None else 1.0
        return self.sampling.temperature, self.sampling.top_p, self.sampling.top_k, penalty


def sample_rows(logits: torch.Tensor, rows: Sequence[SampledRow]) -> list[int | Exception]:
    """The next token of each row of ``logits`` [R, V] (row i by ``rows[i]``), or the exception
    that row's sampling raised. Pushes each sampled token into its row's repetition window."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(rows)} rows")
    results: list[int | Exception | None] = [None] * len(rows)
    logits = _with_offsets(logits, rows, results)
    groups: dict[tuple, list[_Draw]] = {}
    for index, row in enumerate(rows):
        if results[index] is not None:  # (its offsets failed)
            continue
        try:
            draw = _draw_for(index, row, logits.device, logits.shape[-1])
        except Exception as exc:  # noqa: BLE001  this row fails, the others go on
            results[index] = exc
            continue
        groups.setdefault(draw.key, []).append(draw)
    logits, broken = _without_non_finite_rows(logits)
    sampled: list[tuple[_Draw, torch.Tensor]] = []  # each draw with its token (a 1-element device tensor)
    racing: list[tuple[_Draw, torch.Tensor]] = []  # each sampling draw with its distribution [1, V]
    for draws in groups.values():
        for draw, outcome in _sample_group(logits, draws, results):
            (racing if draw.generator is not None else sampled).append((draw, outcome))
    if racing:  # every sampling row of the step in one draw
        tokens = exponential_race(torch.cat([probs for _, probs in racing]), [draw.generator for draw, _ in racing])
        sampled.extend((draw, tokens[position: position + 1]) for position, (draw, _) in enumerate(racing))
    if not sampled:
        return results
    tokens = torch.cat([token for _, token in sampled])
    indices = [draw.index for draw, _ in sampled]
    flagged = broken if indices == list(range(len(rows))) else broken[torch.tensor(indices, device=logits.device)]
    values = torch.where(flagged, -1, tokens).tolist()  # the one read back for the whole batch
    for (draw, token), value in zip(sampled, values):
        if value < 0:
            results[draw.index] = FloatingPointError("the model's logits hold NaN or inf for this sequence")
            continue
        if draw.window is not None:
            try:
                draw.window.push(token)
            except Exception as exc:  # noqa: BLE001
                results[draw.index] = exc
                continue
        results[draw.index] = value
    return results


def _with_offsets(logits: torch.Tensor, rows: Sequence[SampledRow], results: list) -> torch.Tensor:
    """``logits`` with each row's own offsets added (a copy, only when some row has any); a row whose
    offsets fail gets the exception."""
    adjusted = None
    for index, row in enumerate(rows):
        offsets_on = getattr(row, "logit_offsets_on", None)
        if offsets_on is None:
            continue
        try:
            offsets = offsets_on(logits.device, logits.shape[-1])
        except Exception as exc:  # noqa: BLE001  this row fails, the others go on
            results[index] = exc
            continue
        if offsets is not None:
            if adjusted is None:  # a copy: the caller's logits, and every other row's, stay as they were
                adjusted = logits.clone()
            adjusted[index] += offsets.to(logits.dtype)
    return logits if adjusted is None else adjusted


def _draw_for(index: int, row: SampledRow, device: torch.device, vocab: int) -> _Draw:
    sampling = row.sampling
    generator = row.generator_on(device) if sampling.temperature > 0 else None
    window = row.window_on(device, vocab) if sampling.repetition_penalty != 1.0 else None
    if generator is not None and torch.device(generator.device) != device:
        raise SamplingDeviceError(f"the sequence's random generator is on {generator.device} but its logits are on "
                                  f"{device}: a generator must live on the logits' device")
    if window is not None and window.counts.device != device:
        raise SamplingDeviceError(f"the sequence's repetition window is on {window.counts.device} but its logits "
                                  f"are on {device}")
    return _Draw(index, sampling, generator, window)


def _without_non_finite_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with every broken row zeroed, [R] bool: the broken rows), on the device: a row is
    broken when it holds NaN or +inf, or nothing but -inf (no token to draw): exactly the rows whose
    maximum is not finite (a maximum carries a NaN), one pass over the logits instead of four (~2% of a
    served decode step of SmolLM2's 49,152-token vocabulary at 8 rows)."""
    broken = ~torch.isfinite(logits.amax(dim=-1))
    return logits.masked_fill(broken.unsqueeze(1), 0), broken


def _sample_group(logits: torch.Tensor, draws: list[_Draw], results: list) -> list[tuple[_Draw, torch.Tensor]]:
    """The rows sharing their settings: greedy ones' tokens, or sampling ones' distributions [D, V]
    (``(draw, probs)`` per row, drawn later in one race). When the group raises, row by row (a
    failing row gets its exception); no generator has been used yet, so nothing is redrawn."""
    try:
        return _group_outcome(logits, draws)
    except Exception as exc:  # noqa: BLE001
        if len(draws) == 1:
            results[draws[0].index] = exc
            return []
    outcomes = []
    for draw in draws:
        try:
            outcomes.extend(_group_outcome(logits, [draw]))
        except Exception as exc:  # noqa: BLE001
            results[draw.index] = exc
    return outcomes


def _group_outcome(logits: torch.Tensor, draws: list[_Draw]) -> list[tuple[_Draw, torch.Tensor]]:
    """Per row of the group: its token (greedy: a [1] tensor) or its distribution (a [1, V] row)."""
    indices = [draw.index for draw in draws]
    if indices == list(range(logits.shape[0])):
        part = logits
    else:
        part = logits.index_select(0, torch.tensor(indices, device=logits.device))
    sampling = draws[0].sampling
    seen = torch.cat([draw.window.mask() for draw in draws]) if draws[0].window is not None else None
    if draws[0].generator is None:
        tokens = sample(part, sampling, None, seen)
        return [(draw, tokens[position: position + 1]) for position, draw in enumerate(draws)]
    probs = token_probs(part, sampling, seen)
    return [(draw, probs[position: position + 1]) for position, draw in enumerate(draws)]


def exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] (fp32), row i drawn with ``generators[i]``: argmax(p / E),
    E ~ Exponential(1). Each row's E takes V draws from its own generator and nothing else does."""
    noise = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    # (an E of exactly 0 would make 0 / 0 a NaN, which argmax takes: the smallest positive E instead)
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
