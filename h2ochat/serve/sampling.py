"""The next token of every row of a decode step in one call, on the logits' device.

Each row samples with its own settings, its own random stream and its own repetition window
(``SampledRow``: a ``Choice``). Rows that share their settings are sampled together by
``generation.sample`` (each row's draw from its own generator, ``Sampling.row_generators``), so a
row's token is the one ``generation.sample`` gives that row alone with the same generator state. The
tokens of all rows come back to the host in one read.

A row whose sampling fails gets its exception instead of a token and the others are sampled as if
it were not there: a generator or window on another device than the logits (the sampler refuses it
with a clear error, where torch would raise or, on some devices, silently run), logits holding NaN
or +inf (flagged on the device: a GPU's multinomial would otherwise trip a device-side assert that
takes every row down), or anything else ``generation.sample`` raises (the group is then sampled
again row by row from the generator states it started with).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import torch

from ..generation import Sampling, sample
from ..repetition import RecentTokens


class SampledRow(Protocol):
    """What a row samples with; its generator and window are made on the logits' device when first asked."""

    sampling: Sampling

    def generator_on(self, device: torch.device) -> torch.Generator: ...

    def window_on(self, device: torch.device, vocab: int) -> RecentTokens: ...


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
        """Rows with equal keys sample as one batch."""
        penalty = self.sampling.repetition_penalty if self.window is not None else 1.0
        return self.sampling.temperature, self.sampling.top_p, self.sampling.top_k, penalty


def sample_rows(logits: torch.Tensor, rows: Sequence[SampledRow]) -> list[int | Exception]:
    """The next token of each row of ``logits`` [R, V] (row i by ``rows[i]``), or the exception
    that row's sampling raised. Pushes each sampled token into its row's repetition window."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(rows)} rows")
    results: list[int | Exception | None] = [None] * len(rows)
    groups: dict[tuple, list[_Draw]] = {}
    for index, row in enumerate(rows):
        try:
            draw = _draw_for(index, row, logits.device, logits.shape[-1])
        except Exception as exc:  # noqa: BLE001  this row fails, the others go on
            results[index] = exc
            continue
        groups.setdefault(draw.key, []).append(draw)
    logits, broken = _without_non_finite_rows(logits)
    sampled: list[tuple[_Draw, torch.Tensor]] = []  # each draw with its token (a 1-element device tensor)
    for draws in groups.values():
        sampled.extend(_sample_group(logits, draws, results))
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
    broken when it holds NaN or +inf, or nothing but -inf (no token to draw)."""
    broken = (logits.isnan() | logits.isposinf()).any(dim=-1) | logits.isneginf().all(dim=-1)
    return logits.masked_fill(broken.unsqueeze(1), 0), broken


def _sample_group(logits: torch.Tensor, draws: list[_Draw], results: list) -> list[tuple[_Draw, torch.Tensor]]:
    """The tokens of rows sharing their settings, in one ``generation.sample``; when it raises, row
    by row from the generator states the group started with (a failing row gets its exception)."""
    drawing = draws[0].generator is not None
    states = [draw.generator.get_state() for draw in draws] if drawing and len(draws) > 1 else []
    try:
        return _sample_together(logits, draws)
    except Exception as exc:  # noqa: BLE001
        if len(draws) == 1:
            results[draws[0].index] = exc
            return []
    for draw, state in zip(draws, states):  # (rows drawn before the failure drew once already)
        draw.generator.set_state(state)
    sampled = []
    for draw in draws:
        try:
            sampled.extend(_sample_together(logits, [draw]))
        except Exception as exc:  # noqa: BLE001
            results[draw.index] = exc
    return sampled


def _sample_together(logits: torch.Tensor, draws: list[_Draw]) -> list[tuple[_Draw, torch.Tensor]]:
    indices = [draw.index for draw in draws]
    if indices == list(range(logits.shape[0])):
        part = logits
    else:
        part = logits.index_select(0, torch.tensor(indices, device=logits.device))
    sampling = draws[0].sampling
    if draws[0].generator is not None:  # each row draws from its own stream
        sampling = replace(sampling, row_generators=[draw.generator for draw in draws])
    seen = torch.cat([draw.window.mask() for draw in draws]) if draws[0].window is not None else None
    tokens = sample(part, sampling, None, seen)
    return [(draw, tokens[position: position + 1]) for position, draw in enumerate(draws)]
