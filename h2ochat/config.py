"""The settings a run is made with: the cache's (``CacheSettings``: budget, policy and its knobs,
positions, --kv-dtype, recall) and the sampling's (``Sampling``), and the prompt chunk.

Every command declares its cache options from ``CacheSettings``' fields (``options.takes_cache_options``),
the chat's `/set` and the conversation file derive from them (``chat.settings``), and the decode loop
(``generation``) reads them. No torch at import: options are read and checked before anything heavy
loads; the methods that build or measure import what they need.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .budget import budget_bytes, parse_budget, slots_in_bytes
from .model_shape import ConfigOnly, attention_shape, max_positions, model_dtype
from .policies import DEFAULT_POLICY, Policy, get_policy
from .sizes import is_share

if TYPE_CHECKING:
    from .kv import H2OCache

DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per forward (--prefill-chunk)


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
    page: int = 8  # recall's pages (--page): 8 found 45 of 60 held-out keys at 128 slots, 16 found 40 (recall.default)
    selector: str = "auto"  # exact on a CPU, rot4 on a GPU (recall.selector_names.resolved_selector)
    cold_dtype: str = "auto"
    cold_limit: int | None = None
    recall_every: int = 1
    recall_decode_rule: str = "in-step"  # a static-shape step's choice of pages (``RecallConfig.chooses_before``)
    recall_rest: str = "auto"  # recall.tiered.DEFAULT_REST: the rest attended in prompt chunks, on every machine
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
                            self.cold_limit, self.recall_every, decode_rule=self.recall_decode_rule,
                            rest=self.recall_rest)

    def resolved_policy(self) -> Policy:
        """The policy with the knobs given on the command line applied."""
        return get_policy(self.policy).with_knobs(heavy_ratio=self.heavy_ratio, sinks=self.sinks, decay=self.decay)

    def validate(self) -> None:
        """Refuse bad settings before a model is loaded; only the budget's size against the model's
        context window waits for the model (``chat.settings.check_fits``)."""
        from .cache_factory import policy_slots
        from .kv.slot_format import check_kv_dtype
        from .recall.default import read_recall

        if self.positions not in ("compact", "absolute"):
            raise ValueError(f"--positions must be compact or absolute, got {self.positions!r}")
        check_kv_dtype(self.kv_dtype)
        read_recall(self.recall)  # its form; a count against the budget once the slots are known
        if budget_bytes(self.budget) is not None:  # a size: its slots wait for the model (``slots``)
            return
        if is_share(self.budget):  # a share of a window not known yet: the policy's split alone
            self.resolved_policy().split(parse_budget(self.budget, 1 << 30))
            return
        slots = parse_budget(self.budget, 1 << 30)
        self.resolved_policy().split(policy_slots(slots, self.recall_config(slots)))

    def slot_bytes(self, model) -> int:
        """Device bytes of one slot of one layer over its KV heads (keys, values, scales) for
        ``model`` (a configuration alone will do: ``model.config``) with these settings' --kv-dtype."""
        from .kv.slot_format import bytes_per_slot

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
        return slots_in_bytes(size, self.slot_bytes(model if model is not None else ConfigOnly(config)),
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
        from .cache_factory import make_cache
        from .rotary import find_rotary

        config = model.config
        slots = self.slots(config, model)
        policy = self.resolved_policy()
        if policy.grows and initial_slots:
            slots = initial_slots
        recall = self.recall_config(slots) if not policy.grows else None
        return make_cache(config.num_hidden_layers, policy, slots, recall=recall,
                          max_positions=max_positions(config), positions=self.positions, rotary=find_rotary(model),
                          seed=self.seed, static_shapes=static_shapes, kv_dtype=self.kv_dtype)

    def build_for(self, model, tokens: int) -> tuple[H2OCache, bool]:
        """A fresh cache for a text known to end within ``tokens`` tokens (``generate``: the prompt and
        --max-new-tokens), and whether recall was left out: it is when every layer's policy slots hold
        all ``tokens`` (nothing is evicted, so nothing could be recalled, and the same tokens come out
        without recall's per-step work: 28 against 31 tok/s for SmolLM2 bf16 on one thread)."""
        from .kv.tier import NO_TIER

        cache = self.build(model)
        if cache.tier is NO_TIER or any(layer.capacity < tokens for layer in cache.layers):
            return cache, False
        return replace(self, recall=None).build(model), True


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
        import torch

        base = self.seed if self.seed is not None else int(torch.randint(0, 2**31 - 1, ()))
        generators = [torch.Generator(device=device).manual_seed(base + row) for row in range(rows)]
        return replace(self, seed=base, row_generators=generators)
