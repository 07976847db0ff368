"""Feeding tokens through a model and its H2O cache: chunked prefill, sampling, streaming decode.

Every command goes through here: ``CacheSettings.build`` makes the cache for a model,
``prefill`` feeds a prompt in chunks (so peak KV memory is slots + chunk, whatever the prompt
length), ``stream`` yields one ``Step`` per generated token with timings and cache statistics.
Position ids always come from the cache, which is what lets a dialogue run past the model's
position limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..kv import H2OCache
from .compiled import CompiledDecode
# the settings live in config.py; re-exported here because most callers (and tests) still import them from here
from ..config import DEFAULT_PREFILL_CHUNK, CacheSettings, Sampling  # noqa: F401
from .forward_step import Decode, EagerDecode, forward  # noqa: F401  (forward: imported from here)
from ..model_shape import attention_shape, max_positions, model_dtype  # noqa: F401  (imported from here)
from .repetition import RecentTokens
# stream(stop_check_every=...) on an accelerator: tokens generated between two read-backs of the stop
# check (on the CPU every read is free: each op has finished when it returns)
STOP_CHECK_EVERY = 8


def stop_check_interval(device) -> int:
    """How many tokens ``stream`` generates per read-back of the stop check on ``device``."""
    return 1 if torch.device(device).type == "cpu" else STOP_CHECK_EVERY


def decoder(model, compile: bool = False) -> Decode:
    """The decode step for ``model``: compiled (``h2ochat.engine.compiled``; caches it does not cover run
    eagerly) or eager. One decoder serves every turn of a chat and every cache of the model."""
    return CompiledDecode(model) if compile else EagerDecode(model)


def inference_steps(steps: Iterator):
    """Advance a generation stream in inference mode. Each forward already is, but between forwards
    the cache may re-number positions, rotating its (inference-mode) keys in place, which torch
    refuses outside inference mode."""
    while True:
        with torch.inference_mode():
            try:
                item = next(steps)
            except StopIteration:
                return
        yield item


def chunk_size(cache: H2OCache, remaining: int, chunk: int) -> int:
    """How many of the ``remaining`` prompt tokens the next forward reads: ``chunk`` at most, and
    where a re-numbering is due inside it, up to the re-numbering (then a chunk that fits beside the
    re-numbered slots, positions 0..C-1)."""
    size = min(chunk, remaining)
    room = cache.room_before_renumbering()
    if cache.evicts and cache.position_mode == "compact" and size > room:
        largest = max(layer.capacity for layer in cache.layers)
        size = room if room > 0 else max(1, min(size, cache.max_positions - largest))
    return size


def prefill(model, cache: H2OCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            chunk: int = DEFAULT_PREFILL_CHUNK, should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
    """Feed a prompt [B, T] in chunks; returns the logits of its last token [B, V].
    ``should_stop`` is asked between chunks (a Ctrl-C noted by a signal handler during a long
    prompt): True raises KeyboardInterrupt there, with the cache holding the chunks fed so far."""
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    if attention_mask is not None and not bool(attention_mask[:, -1].all()):  # a chunk alone cannot tell
        raise ValueError("right-padded batches are not supported (the last token of a row is padding): "
                         "pad on the left (tokenizer.padding_side = 'left')")
    logits = None
    start, total = 0, input_ids.shape[1]
    while start < total:
        if should_stop is not None and start > 0 and should_stop():
            raise KeyboardInterrupt
        size = chunk_size(cache, total - start, chunk)
        piece = input_ids[:, start : start + size]
        mask = attention_mask[:, start : start + size] if attention_mask is not None else None
        logits = forward(model, cache, piece, mask, logits_to_keep=1)
        start += size
    return logits[:, -1]


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor | RecentTokens, penalty: float) -> torch.Tensor:
    """Make tokens already in the text (``seen`` [B, V] bool, or the recent-token window) less likely:
    positive logits are divided by ``penalty``, negative ones multiplied (the CTRL paper's rule, as
    transformers does)."""
    if isinstance(seen, RecentTokens):
        seen = seen.mask()
    logits = logits.float()
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None,
           seen: torch.Tensor | RecentTokens | None = None) -> torch.Tensor:
    """Next token per row of ``logits`` [B, V]; ``seen`` marks tokens in the text the penalty sees
    ([B, V] bool, or a ``RecentTokens`` window)."""
    if sampling.temperature == 0:
        if seen is not None and sampling.repetition_penalty != 1.0:
            logits = penalize_repeats(logits, seen, sampling.repetition_penalty)
        return logits.argmax(dim=-1)
    probs = token_probs(logits, sampling, seen)
    if sampling.row_generators is not None:  # each row its own stream, whatever the batch holds
        return torch.cat([torch.multinomial(probs[row : row + 1], 1, generator=g)
                          for row, g in enumerate(sampling.row_generators)]).squeeze(1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def token_probs(logits: torch.Tensor, sampling: Sampling, seen: torch.Tensor | RecentTokens | None = None
                ) -> torch.Tensor:
    """The distribution ``sample`` draws from at a temperature above 0 (fp32 [B, V]): the repetition
    penalty, the temperature, top-k and top-p applied to ``logits``."""
    if seen is not None and sampling.repetition_penalty != 1.0:
        logits = penalize_repeats(logits, seen, sampling.repetition_penalty)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) > sampling.top_p
        drop = drop_sorted.scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


@dataclass
class Step:
    """One generated token (for every sequence of the batch) and where things stand."""

    tokens: torch.Tensor  # [B]
    index: int  # 0 for the first generated token
    elapsed_s: float  # decode time so far (first token excluded: it comes with the prefill)


@dataclass
class Timing:
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    generated_tokens: int = 0
    decode_s: float = 0.0
    # tokens the cache was fed after the last one yielded was generated (stream with
    # stop_check_every > 1 learns of a stop only at its next read-back; a cache that leaves finished
    # rows out of the decode steps is fed none: only a recall cache counts them): in the cache's
    # counts and statistics, not in the text
    fed_past_stop: int = 0
    # the first decode step's seconds: with --compile it holds the compilation, which the steady
    # rate below leaves out
    first_step_s: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # the first token comes out of the prefill; decode speed counts the steps after it
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    @property
    def steady_decode_tokens_per_s(self) -> float:
        """Decode speed after the first decode step (its compilation, warm-up of the kernels)."""
        steps = self.generated_tokens - 2
        rest = self.decode_s - (self.first_step_s or 0.0)
        return steps / rest if steps > 0 and rest > 0 else 0.0


def stream(
    model,
    cache: H2OCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: set[int] | frozenset[int] = frozenset(),
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    timing: Timing | None = None,
    compile: bool = False,
    decode: Decode | None = None,
    stop_check_every: int = 1,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[Step]:
    """Prefill ``input_ids`` then generate up to ``max_new_tokens``, yielding each step.

    Stops early when every sequence has produced a stop id. The last generated token is not fed
    back (nothing would read its keys), so the cache has seen prompt + generated - 1 tokens.
    A caller that continues the conversation feeds it first.

    ``decode``: the decode step (``decoder(model, compile)``; a chat keeps one for all its turns);
    without one, ``decoder(model, compile)``: ``compile`` runs decode steps as one compiled graph
    (``h2ochat.engine.compiled``; the cache switches to static shapes; caches it does not cover, the
    random and full policies, stay eager).

    Finished rows sit out: once a row has drawn a stop id, the decode steps leave it out (an
    ``active`` mask, built on the device and never read back: ``H2OCache.position_ids``), so its
    cache holds exactly what it held when it finished, whatever the other rows still generate.
    ``stop_check_every`` = k > 1 reads the stop check back once per k tokens instead of after each
    one, so the host does not wait for the device between steps: the steps are yielded in bursts of
    k, the same tokens as with k = 1, and the same cache: the steps queued after the last row
    finished feed nobody (their host counters are put back at the read-back), so the cache can be
    reused (the chat does). A caller that stops reading inside a burst (the chat after a base
    model's "User:", a stop the device cannot see) leaves the cache fed to the burst's end: the
    chat then reads the whole conversation again at the next turn. A cache whose layers cannot
    leave rows out (``H2OCache.masks_inactive_rows`` False: the recall tier) keeps feeding finished
    rows: then up to k - 1 tokens are fed past the last one yielded (counted in
    ``timing.fed_past_stop``), fine for a generation whose cache is thrown away (the chat reads
    such a cache after every token).
    ``should_stop`` is asked between prefill chunks and before each decode step: True ends the
    generation there (with the steps already produced yielded; during the prefill it raises
    KeyboardInterrupt), with the cache fed every yielded token but the last, as for a stop id.
    """
    sampling.validate()
    if stop_check_every < 1:
        raise ValueError(f"stop_check_every must be >= 1, got {stop_check_every}")
    decode = decode if decode is not None else decoder(model, compile)
    timing = timing if timing is not None else Timing()
    generator = torch.Generator(device=input_ids.device).manual_seed(sampling.seed) if sampling.seed is not None else None
    started = time.perf_counter()
    logits = prefill(model, cache, input_ids, attention_mask, prefill_chunk, should_stop)
    timing.prompt_tokens += int(attention_mask.sum()) if attention_mask is not None else input_ids.numel()
    timing.prefill_s += time.perf_counter() - started
    batch = input_ids.shape[0]
    finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    stops = torch.tensor(sorted(stop_ids), device=input_ids.device) if stop_ids else None
    bursts = stops is not None and stop_check_every > 1
    # finished rows sit the decode steps out (a single row with k = 1 never decodes once finished)
    leave_out = stops is not None and cache.masks_inactive_rows and (bursts or batch > 1)
    seen = None
    if sampling.repetition_penalty != 1.0:  # the last repeat_last_n tokens of the text, padding excluded
        seen = RecentTokens(input_ids, attention_mask, logits.shape[-1], sampling.repeat_last_n)
    decode_started = time.perf_counter()
    fed_before = timing.fed_past_stop
    tokens = None
    # steps waiting for the next read-back of the stop check: (step, every row finished, the host
    # counters before the decode step that produced it)
    held: list[tuple[Step, torch.Tensor, object]] = []
    for index in range(max_new_tokens):
        counters = None
        if tokens is not None:  # feed the previous token; the last one is never fed
            if should_stop is not None and should_stop():
                break
            if leave_out:
                counters = cache.host_counters() if bursts else None
                logits = decode(cache, tokens, active=~finished)
            else:
                logits = decode(cache, tokens)
        tokens = sample(logits, sampling, generator, seen)
        if seen is not None:
            seen.push(tokens)
        if index == 0:
            decode_started = time.perf_counter()
            elapsed = timing.decode_s
        else:
            elapsed = time.perf_counter() - decode_started
            if index == 1 and timing.first_step_s is None:
                timing.first_step_s = elapsed
        step = Step(tokens=tokens, index=index, elapsed_s=elapsed)
        if not bursts:
            timing.generated_tokens += 1
            timing.decode_s = elapsed
            yield step
            if stops is not None:
                finished = finished | torch.isin(tokens, stops)
                if bool(finished.all()):
                    break
            continue
        finished = finished | torch.isin(tokens, stops)  # a new tensor per step: each is read back later
        held.append((step, finished.all(), counters))
        if len(held) == stop_check_every or index == max_new_tokens - 1:
            if (yield from _read_back(held, timing, cache if leave_out else None, fed_before, index)):
                return  # every row finished
    if held:  # ended by should_stop: what was produced before it
        yield from _read_back(held, timing, cache if leave_out else None, fed_before, held[-1][0].index)


def _read_back(held: list, timing: Timing, masked_cache: H2OCache | None, fed_before: int, last: int):
    """Yield the held steps of a burst (emptying ``held``) after one read-back of their stop flags,
    up to the first at which every row had finished; returns whether there was one. A cache that
    left finished rows out gets its host counters back from before the first decode step that fed
    nobody; otherwise the tokens fed past the stop are counted."""
    done = torch.stack([flag for _, flag, _ in held]).tolist()  # one read-back for k steps
    steps = list(held)
    held.clear()
    for position, ((step, _, _), stop) in enumerate(zip(steps, done)):
        timing.generated_tokens += 1
        timing.decode_s = step.elapsed_s
        if masked_cache is None:
            # the steps after this one in the burst each fed their previous token: set before
            # the yield, so it is right wherever the caller stops reading
            timing.fed_past_stop = fed_before + last - step.index
        if stop and masked_cache is not None and position + 1 < len(steps):
            masked_cache.restore_host_counters(steps[position + 1][2])
        yield step
        if stop:
            return True
    return False
