"""Eviction policies: one object per policy that says everything that makes it what it is.

A ``Policy`` declares
- its split of the budget: ``sinks`` (the first tokens, pinned), a recent window (pinned) and heavy
  slots (kept on merit), per layer when ``layer_shape`` shapes the budgets by depth;
- its score update: ``decay`` (S <- decay * S + a_t; 1 = the paper's sum, 0 = this step only);
- its ranking of the evictable tokens: by score, by score / age (``by_age``), times the value norm
  (``value_eps``), or oldest first (``oldest_first``); a subclass may override ``rank``;
- its protected set (sinks + recent window), stated once in ``h2ochat_kernels.protected_slots``
  and used by the cache, eval, bench and the UI alike.

Everything a policy does not decide is shared: empty and padding slots go first, and exactly the
lowest-ranked unprotected token is dropped. A new policy is one entry in ``POLICIES`` (or a
subclass with its own ``rank``); ``get_policy("name:knob=value:...")`` overrides its knobs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# torch and the kernels are imported by the functions that compute: naming, splitting and checking
# a policy (the command line's --help and option checks) must not wait seconds for torch

DEFAULT_POLICY = "h2o"


@dataclass(frozen=True)
class SlotBudget:
    """How the slots of one (layer, sequence, KV head) are shared out."""

    slots: int  # capacity C; for the full policy the initial allocation (it grows)
    heavy: int  # slots for tokens kept on merit (heavy hitters)
    recent: int  # the R most recent tokens, never evicted
    sinks: int = 0  # the first N tokens, never evicted (StreamingLLM)
    evicts: bool = True  # False: the full cache, which grows instead

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError(f"the cache needs at least 1 slot, got {self.slots}")
        if self.evicts and self.recent < 1:
            raise ValueError("the recent window needs at least 1 slot (the token being generated)")
        if self.evicts and self.heavy + self.recent + self.sinks != self.slots:
            raise ValueError("heavy + recent + sinks must add up to the slots")


# knob name -> (field, parser); what `name:knob=value` and the CLI options may set
KNOBS = {
    "decay": float,
    "heavy_ratio": float,
    "sinks": int,
    "value_eps": float,
    "layer_shape": float,
}


@dataclass(frozen=True)
class Policy:
    name: str
    summary: str
    decay: float = 1.0  # score update S <- decay * S + a_t
    heavy_ratio: float = 0.5  # share of the non-sink slots kept on merit; the rest is the recent window
    sinks: int = 0  # first tokens never evicted
    by_age: bool = False  # rank by mean attention per step seen (S / age)
    value_eps: float | None = None  # rank (S + eps) * ||v|| when set
    oldest_first: bool = False  # rank by token index: a window (plus sinks)
    layer_shape: float = 0.0  # > 0: more slots in lower layers (pyramid); < 0: upper layers (funnel)
    grows: bool = False  # the full cache: never evicts, grows instead

    def __post_init__(self):
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {self.decay}")
        if not 0.0 <= self.heavy_ratio < 1.0:
            raise ValueError(f"heavy_ratio must be in [0, 1), got {self.heavy_ratio}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.value_eps is not None and self.value_eps < 0:
            raise ValueError(f"value_eps must be >= 0, got {self.value_eps}")
        if not -1.0 < self.layer_shape < 1.0:
            raise ValueError(f"layer_shape must be in (-1, 1), got {self.layer_shape}")

    # -- identity ---------------------------------------------------------------------------------
    def with_knobs(self, **knobs) -> "Policy":
        """This policy with some knobs changed (None values are ignored)."""
        changes = {k: v for k, v in knobs.items() if v is not None}
        unknown = set(changes) - set(KNOBS)
        if unknown:
            raise ValueError(f"unknown policy knob(s) {', '.join(sorted(unknown))}; knobs: {', '.join(KNOBS)}")
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def label(self) -> str:
        """The name plus the knobs that differ from the registered policy's (``decay:decay=0.9``)."""
        base = POLICIES.get(self.name)
        if base is None:
            return self.name
        changed = [f"{k}={getattr(self, k):g}" for k in KNOBS
                   if getattr(self, k) != getattr(base, k) and getattr(self, k) is not None]
        return ":".join([self.name, *changed])

    @property
    def uses_value_norm(self) -> bool:
        return self.value_eps is not None

    @property
    def evicts(self) -> bool:
        return not self.grows

    # -- the budget -------------------------------------------------------------------------------
    def split(self, slots: int) -> SlotBudget:
        """Share ``slots`` out: sinks first, then heavy slots, the rest is the recent window."""
        if self.grows:
            return SlotBudget(slots, heavy=0, recent=slots, evicts=False)
        if self.sinks and not self.sinks < slots:
            raise ValueError(f"{self.name}: --sinks {self.sinks} needs at least {self.sinks + 1} slots, got {slots}")
        rest = slots - self.sinks
        heavy = min(int(rest * self.heavy_ratio), rest - 1)
        return SlotBudget(slots, heavy=heavy, recent=rest - heavy, sinks=self.sinks)

    def layer_slots(self, slots: int, num_layers: int) -> list[int]:
        """Slots per layer, adding up to ``slots * num_layers``: flat, or a linear ramp by depth
        (PyramidKV's direction for layer_shape > 0, Scissorhands' funnel for < 0)."""
        if not self.layer_shape or num_layers < 2 or self.grows:
            return [slots] * num_layers
        least = self.sinks + 2  # every layer keeps its sinks, one heavy and one recent slot
        shape = [1 + self.layer_shape * (1 - 2 * layer / (num_layers - 1)) for layer in range(num_layers)]
        per_layer = [max(least, round(slots * s)) for s in shape]
        per_layer[-1] = max(least, per_layer[-1] + slots * num_layers - sum(per_layer))  # rounding drift
        return per_layer

    def layer_budgets(self, slots: int, num_layers: int) -> list[SlotBudget]:
        return [self.split(s) for s in self.layer_slots(slots, num_layers)]

    # -- ranking ----------------------------------------------------------------------------------
    def rank(self, scores: torch.Tensor, token_index: torch.Tensor, newest: torch.Tensor,
             value_norm: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Merit of every slot [B, Hkv, S] (higher = keep); protected and empty slots are handled
        by the caller. ``newest`` [B] is each sequence's newest token index."""
        import h2ochat_kernels as kernels

        return kernels.slot_rank(scores, token_index, newest, value_norm, oldest_first=self.oldest_first,
                                 by_age=self.by_age, value_eps=self.value_eps)

    @property
    def fused_eviction(self) -> dict | None:
        """The parameters of this policy's rank for the one-launch eviction, or None when its rank
        is not one of the built-in formulas (a subclass overriding ``rank``)."""
        if type(self).rank is not Policy.rank:
            return None
        return dict(oldest_first=self.oldest_first, by_age=self.by_age, value_eps=self.value_eps)


class RandomPolicy(Policy):
    """A random unprotected token goes: the sanity baseline every real policy must beat."""

    def rank(self, scores, token_index, newest, value_norm=None, generator=None):
        # a seeded generator lives on one device (the CPU): draw there, then move
        import torch

        device = generator.device if generator is not None else scores.device
        return torch.rand(scores.shape, generator=generator, device=device).to(scores.device)


def protected(token_index: torch.Tensor, newest: torch.Tensor, budget: SlotBudget) -> torch.Tensor:
    """[B, Hkv, S] bool: the slots ``budget`` never evicts (recent window and sinks)."""
    import h2ochat_kernels as kernels

    return kernels.protected_slots(token_index, newest, budget.recent, budget.sinks)


def keep_priority(policy: Policy, budget: SlotBudget, scores: torch.Tensor, token_index: torch.Tensor,
                  newest: torch.Tensor, value_norm: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Priority of every slot [B, Hkv, S] (higher = keep): +inf protected, -inf empty or padding,
    the policy's rank otherwise."""
    import h2ochat_kernels as kernels

    rank = policy.rank(scores, token_index, newest, value_norm, generator)
    return kernels.keep_priority(rank, token_index, newest, budget.recent, budget.sinks)


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("h2o", "the paper: heavy hitters by accumulated attention + recent window"),
        Policy("local", "recent window only (sliding window)", heavy_ratio=0.0, oldest_first=True),
        Policy("sink", "first 4 tokens + recent window (StreamingLLM)", heavy_ratio=0.0, sinks=4, oldest_first=True),
        RandomPolicy("random", "a random non-recent token goes (a sanity baseline)"),
        Policy("full", "no eviction: the cache grows with the text", grows=True, oldest_first=True),
        Policy("decay", "heavy hitters by decayed attention (S <- 0.9 S + a) + 4 sinks + recent window",
               decay=0.9, sinks=4),
        Policy("mean", "heavy hitters by mean attention over their age + 4 sinks + recent window",
               sinks=4, by_age=True),
        Policy("tova", "heavy hitters by this step's attention only (TOVA) + 4 sinks + recent window",
               decay=0.0, sinks=4),
    )
}


def parse_policy(spec: str) -> Policy:
    """``name`` or ``name:knob=value:knob=value`` (knobs: decay, heavy_ratio, sinks, value_eps,
    layer_shape)."""
    name, *assignments = [part.strip() for part in str(spec).split(":")]
    base = POLICIES.get(name.lower())
    if base is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    knobs = {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in KNOBS:
            raise ValueError(f"policy knob {assignment!r}: write knob=value with a knob among {', '.join(KNOBS)}")
        try:
            knobs[key] = KNOBS[key](value)
        except ValueError:
            raise ValueError(f"policy knob {key}: {value!r} is not a number") from None
    return base.with_knobs(**knobs)


def get_policy(spec: str | Policy) -> Policy:
    return spec if isinstance(spec, Policy) else parse_policy(spec)


def describe_policies() -> list[tuple[str, str]]:
    """(name, one line) for every registered policy, for --help and /policy."""
    return [(p.name, p.summary) for p in POLICIES.values()]
