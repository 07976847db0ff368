"""Feeding tokens through a model and its H2O cache: chunked prefill, sampling, streaming decode.

Every command goes through here: ``CacheSettings.build`` makes the cache for a model,
``prefill`` feeds a prompt in chunks (so peak KV memory is slots + chunk, whatever the prompt
length), ``stream`` yields one ``Step`` per generated token with timings and cache statistics.
Position ids always come from the cache, which is what lets a dialogue run past the model's
position limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from .budget import budget_bytes, parse_budget, slots_in_bytes
from .kv import H2OCache, make_cache, policy_slots
from .kv.slot_format import bytes_per_slot, check_kv_dtype
from .compiled import CompiledDecode
from .forward_step import Decode, EagerDecode, forward
from .policies import DEFAULT_POLICY, Policy, get_policy
from .repetition import RecentTokens
from .rotary import find_rotary

DEFAULT_PREFILL_CHUNK = 512
# stream(stop_check_every=...) on an accelerator: tokens generated between two read-backs of the stop
# check (on the CPU every read is free: each op has finished when it returns)
STOP_CHECK_EVERY = 8


def stop_check_interval(device) -> int:
    """How many tokens ``stream`` generates per read-back of the stop check on ``device``."""
    return 1 if torch.device(device).type == "cpu" else STOP_CHECK_EVERY


def max_positions(config) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 2048)


def attention_shape(config) -> tuple[int, int]:
    """(KV heads, head dim) of a model's attention, from its configuration."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def model_dtype(model) -> torch.dtype:
    """The dtype a model computes in (its keys and values): its parameters', else its configuration's
    (a configuration alone, before the weights load), else float32."""
    parameter = next(model.parameters(), None) if hasattr(model, "parameters") else None
    if parameter is not None:
        return parameter.dtype
    dtype = getattr(model.config, "dtype", None)  # (torch_dtype: deprecated, it warns when read)
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype or "float32"), torch.float32)


@dataclass
class CacheSettings:
    policy: str = DEFAULT_POLICY  # a name, or name:knob=value:... (see policies.parse_policy)
    budget: str = "0.2"
    heavy_ratio: float | None = None  # None: the policy's own
    sinks: int | None = None
    decay: float | None = None
    positions: str = "compact"
    seed: int | None = None
    # two tiers (h2ochat.recall): R of the budget's slots hold tokens recalled from the cold store
    recall: str | None = None  # slots (64), a share of the budget (0.5), auto (recall.default); None or 0: no recall
    page: int = 16
    selector: str = "rot4"
    cold_dtype: str = "same"
    cold_limit: int | None = None
    recall_every: int = 1
    # how the slots hold keys and values (kv.slot_format): auto (the model's dtype), a float type, int8, int4
    kv_dtype: str = "auto"

    def recall_config(self, slots: int):
        """The recall settings for a budget of ``slots``, or None without recall (``--recall auto``:
        half the slots once the budget holds enough, ``recall.default``)."""
        from .recall.default import recall_spec

        spec = recall_spec(self.recall, slots, self.page, self.resolved_policy().evicts)
        if spec is None:
            return None
        from .recall.tiered import RecallConfig, recall_slots

        return RecallConfig(recall_slots(spec, slots), self.page, self.selector, self.cold_dtype,
                            self.cold_limit, self.recall_every)

    def resolved_policy(self) -> Policy:
        """The policy with the knobs given on the command line applied."""
        return get_policy(self.policy).with_knobs(heavy_ratio=self.heavy_ratio, sinks=self.sinks, decay=self.decay)

    def validate(self) -> None:
        """Refuse bad settings before a model is loaded; only the budget's size against the model's
        context window waits for the model."""
        if self.positions not in ("compact", "absolute"):
            raise ValueError(f"--positions must be compact or absolute, got {self.positions!r}")
        check_kv_dtype(self.kv_dtype)
        if budget_bytes(self.budget) is not None:  # a size: its slots wait for the model (``slots``)
            return
        slots = parse_budget(self.budget, 1 << 30)
        recall = self.recall_config(slots)
        self.resolved_policy().split(policy_slots(slots, recall))

    def slot_bytes(self, model) -> int:
        """Device bytes of one slot of one layer over its KV heads (keys, values, scales) for
        ``model`` (a configuration alone will do: ``model.config``) with these settings' --kv-dtype."""
        heads, head_dim = attention_shape(model.config)
        return heads * bytes_per_slot(self.kv_dtype, head_dim, head_dim, model_dtype(model))

    def slots(self, config, model=None) -> int:
        """Slots per layer (the device's: recall slots included) for the budget: a share or a count
        of the model's window, or the slots whose bytes fit a size (``model``: for its dtype under
        --kv-dtype auto; the configuration's dtype without it)."""
        size = budget_bytes(self.budget)
        if size is None:
            return parse_budget(self.budget, max_positions(config))
        layers = config.num_hidden_layers
        return slots_in_bytes(size, self.slot_bytes(model if model is not None else _ConfigOnly(config)),
                              self.resolved_policy().layer_slots, layers, typed=str(self.budget).strip(),
                              kv_dtype=self.kv_dtype)

    def kv_slots_needed(self, prefill_chunk: int):
        """For the memory check before loading: slots per layer a cache of these settings reaches
        (its budget plus a prompt chunk beside it; the full policy, the whole window), from a config."""
        if self.resolved_policy().grows:
            return lambda config: max_positions(config)
        return lambda config: self.slots(config) + prefill_chunk

    def build(self, model, initial_slots: int | None = None, *, static_shapes: bool = False) -> H2OCache:
        """A fresh cache for ``model``. ``initial_slots`` sizes the full policy's first allocation."""
        config = model.config
        slots = self.slots(config, model)
        policy = self.resolved_policy()
        if policy.grows and initial_slots:
            slots = initial_slots
        recall = self.recall_config(slots) if not policy.grows else None
        return make_cache(config.num_hidden_layers, policy, slots, recall=recall,
                          max_positions=max_positions(config), positions=self.positions, rotary=find_rotary(model),
                          seed=self.seed, static_shapes=static_shapes, kv_dtype=self.kv_dtype)


class _ConfigOnly:
    """A model known by its configuration only (the checks before the weights load)."""

    def __init__(self, config):
        self.config = config


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the text (1 = off)
    # the penalty looks at the last N tokens only (0 or -1: the whole text), as llama.cpp's
    # repeat_last_n: penalising every token ever written starves a long story of common words
    repeat_last_n: int = 64
    # one generator per row (story -n): each continuation draws from its own seeded stream
    row_generators: list | None = field(default=None, repr=False, compare=False)

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be a token count, 0 or -1 (the whole text), got {self.repeat_last_n}")

    def with_row_seeds(self, rows: int, device) -> "Sampling":
        """A copy whose rows draw from generators seeded seed, seed+1, ... (a random seed when unset)."""
        base = self.seed if self.seed is not None else int(torch.randint(0, 2**31 - 1, ()))
        generators = [torch.Generator(device=device).manual_seed(base + row) for row in range(rows)]
        return replace(self, seed=base, row_generators=generators)


def decoder(model, compile: bool = False) -> Decode:
    """The decode step for ``model``: compiled (``h2ochat.compiled``; caches it does not cover run
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
        size = min(chunk, total - start)
        room = cache.room_before_renumbering()
        if cache.evicts and cache.position_mode == "compact" and size > room:
            # a re-numbering is due inside this chunk: feed up to it, then a chunk that fits beside
            # the re-numbered slots (positions 0..C-1)
            largest = max(layer.capacity for layer in cache.layers)
            size = room if room > 0 else max(1, min(size, cache.max_positions - largest))
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
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # the first token comes out of the prefill; decode speed counts the steps after it
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


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
    (``h2ochat.compiled``; the cache switches to static shapes; caches it does not cover, the
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
