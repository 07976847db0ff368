"""The settings of a chat: ``ChatSettings`` (the system prompt, the ``Sampling``, the reply's length
and the cache's ``CacheSettings``), the table of settable names `/set` and `run --continue` derive from its
fields (``SETTINGS``), and ``check_fits``: cache settings against a model's real limits.

Its own module because every command reads it (run, generate, story, the option checks), not
only the conversation, and it knows nothing of messages or caches being fed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import get_args, get_type_hints

from ..errors import UserError, user_input
from ..config import CacheSettings, Sampling
from ..model_shape import max_positions


# extra names `/set` accepts besides each field's own (and its spelling with dashes)
ALIASES: dict[str, tuple[str, ...]] = {
    "temperature": ("temp", "t"),
    "top_p": ("topp",),
    "top_k": ("topk",),
    "repetition_penalty": ("repeat_penalty", "repeat-penalty"),
    "repeat_last_n": ("last_n", "last-n"),
    "max_new_tokens": ("max_tokens", "max-tokens", "num_predict"),
    "system": ("system_prompt",),
}

NONE_WORDS = ("none", "off", "default", "random", "")


def chat_sampling() -> Sampling:
    """The chat's sampling: Sampling's own defaults but a temperature of 0.7 (a chat that samples
    reads less mechanically than greedy decoding; `generate` and the measurements stay greedy)."""
    return Sampling(temperature=0.7)


# Sampling's fields that are settings: row_generators is state built per call (compare=False), not a choice
SAMPLING_FIELDS = tuple(f.name for f in fields(Sampling) if f.compare)


@dataclass
class ChatSettings:
    """Everything that shapes a reply; saved with the conversation.

    The list of settings is this class's own fields, Sampling's and CacheSettings' (see
    ``SETTINGS``): `/set`, its listing, the conversation file and `run --continue`'s overrides all
    derive from them, so a new field is wired everywhere or a test says where it is not."""

    system: str | None = None
    sampling: Sampling = field(default_factory=chat_sampling)  # its seed is the cache's too (random policy)
    max_new_tokens: int = 512
    cache: CacheSettings = field(default_factory=CacheSettings)

    def validate(self) -> None:
        """Refuse bad values (a UserError in one line); the budget against a model's context
        window is checked by ``check_fits``."""
        with user_input():
            self.sampling.validate()
            if self.max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
            self.cache.validate()

    def copy(self) -> "ChatSettings":
        return replace(self, sampling=replace(self.sampling), cache=replace(self.cache))

    def _part(self, owner: str):
        return getattr(self, owner) if owner else self

    def get(self, name: str):
        return getattr(self._part(SETTINGS[name].owner), name)

    def with_value(self, name: str, value: str) -> tuple["ChatSettings", str]:
        """A copy with one setting changed from text (``/set temperature 0.7``) and the setting's
        canonical name; self is left as it is. UserError for an unknown name or a bad value."""
        setting = find_setting(name)
        try:
            parsed = setting.parse(value.strip())
        except ValueError:
            raise UserError(f"{setting.name} needs {setting.kind} value, got {value.strip()!r}") from None
        changed = self.with_values({setting.name: parsed})
        changed.validate()
        return changed, setting.name

    def with_values(self, values: dict[str, object]) -> "ChatSettings":
        """A copy with the named settings (``SETTINGS``' names) replaced; self is left as it is."""
        by_owner: dict[str, dict[str, object]] = {owner: {} for owner in PARTS}
        for name, value in values.items():
            by_owner[SETTINGS[name].owner][name] = value
        if "seed" in values:  # one seed: sampling and the random policy
            by_owner["cache"]["seed"] = values["seed"]
        parts = {owner: replace(getattr(self, owner), **by_owner[owner]) for owner in PARTS if owner}
        return replace(self, **parts, **by_owner[""])

    def listing(self) -> list[tuple[str, object]]:
        """Every setting and its value, in field order (what `/set` alone shows)."""
        return [(name, self.get(name)) for name in SETTINGS]

    def to_json(self) -> dict:
        """The file's shape: every setting but the cache's under its own name (the names `/set` takes,
        and the shape files had before Sampling was a part of its own, so files read both ways between
        versions), the cache's under "cache" as they always were."""
        flat = {name: value for name, value in self.listing() if SETTINGS[name].owner != "cache"}
        return {**flat, "cache": asdict(self.cache)}

    @classmethod
    def from_options(cls, options: dict) -> "ChatSettings":
        """Settings from a command's options named as the settings (``run``'s: every setting is one; the
        sampling seed is the cache's too). UserError for a bad value."""
        settings = cls.from_values({name: options[name] for name in SETTINGS if name in options
                                    and not SETTINGS[name].on_cache},
                                   CacheSettings(**{f.name: options[f.name] for f in fields(CacheSettings)
                                                    if f.name in options}))
        settings.validate()
        return settings

    @classmethod
    def from_values(cls, values: dict[str, object], cache: CacheSettings | None = None) -> "ChatSettings":
        """Settings from the settings that are not the cache's, by ``SETTINGS``' names (the others take
        the chat's defaults). KeyError for a name that is no such setting."""
        wrong = [name for name in values if name not in SETTINGS or SETTINGS[name].on_cache]
        if wrong:
            raise KeyError(f"not a sampling or reply setting: {', '.join(wrong)}")
        sampling = {name: value for name, value in values.items() if SETTINGS[name].owner == "sampling"}
        own = {name: value for name, value in values.items() if SETTINGS[name].owner == ""}
        return cls(**own, sampling=replace(chat_sampling(), **sampling), cache=cache or CacheSettings())

    @classmethod
    def from_json(cls, data: dict) -> "ChatSettings":
        names = {f.name for f in fields(CacheSettings)}
        stored = data.get("cache") if isinstance(data.get("cache"), dict) else {}
        cache = CacheSettings(**{k: v for k, v in stored.items() if k in names})
        known = {name: data[name] for name in SETTINGS if name in data and SETTINGS[name].owner != "cache"}
        settings = cls.from_values(known, cache)
        try:
            settings.validate()
        except TypeError as exc:  # a hand-edited file: "temperature": "hot"
            raise UserError(f"the stored settings do not read: {exc}") from None
        return settings


@dataclass(frozen=True)
class Setting:
    """One setting as `/set` and `run --continue` see it."""

    name: str
    owner: str  # the part of ChatSettings holding it: "sampling", "cache" (a change means a new cache) or ""
    type: type
    optional: bool  # None is a value ("default", "off")

    @property
    def on_cache(self) -> bool:
        return self.owner == "cache"

    @property
    def kind(self) -> str:
        return {int: "an integer", float: "a number"}.get(self.type, "a")

    @property
    def aliases(self) -> tuple[str, ...]:
        return (self.name.replace("_", "-"), *ALIASES.get(self.name, ()))

    def parse(self, text: str):
        if self.optional and text.lower() in NONE_WORDS:
            return None
        return self.type(text)


# the parts of ChatSettings that hold settings of their own ("" is ChatSettings itself)
PARTS = {"": ChatSettings, "sampling": Sampling, "cache": CacheSettings}


def _settings_from_fields() -> dict[str, Setting]:
    """ChatSettings' fields in order, each part's (sampling, cache) spelled out in its place."""
    table: dict[str, Setting] = {}

    def add(owner: str) -> None:
        hints = get_type_hints(PARTS[owner])
        for f in fields(PARTS[owner]):
            if owner == "" and f.name in PARTS:
                add(f.name)
            elif f.compare and f.name not in table:  # the cache's seed follows the sampling's
                kinds = [t for t in get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
                table[f.name] = Setting(f.name, owner, kinds[0], type(None) in get_args(hints[f.name]))

    add("")
    return table


SETTINGS: dict[str, Setting] = _settings_from_fields()


def find_setting(name: str) -> Setting:
    key = name.strip().lower()
    for setting in SETTINGS.values():
        if key == setting.name or key in setting.aliases:
            return setting
    raise UserError(f"cannot set {name!r}; settable: {', '.join(SETTINGS)}")


def check_fits(settings: CacheSettings, model) -> None:
    """The cache settings against this model's real limits (its context window, its depth), before
    anything is built or dropped: a UserError in one line when they do not fit."""
    from ..cache_factory import policy_slots

    with user_input():
        settings.validate()
        slots = settings.slots(model.config, model)
        policy = settings.resolved_policy()
        window = max_positions(model.config)
        if slots > window and not policy.grows:  # never filled: the positions run out first
            as_slots = "" if str(settings.budget).strip() == str(slots) else f" ({slots} slots)"
            raise UserError(f"budget {settings.budget}{as_slots} is more than this model's {window}-position "
                            f"context window (1.0 is the whole window)")
        hot = policy_slots(slots, settings.recall_config(slots))  # recall slots (--recall) are not the policy's
        policy.split(hot)
        policy.layer_budgets(hot, model.config.num_hidden_layers)


def check_recall(settings: CacheSettings) -> None:
    """The recall options of ``settings`` whether or not recall is on (``CacheSettings.validate`` reads
    them only with --recall, so `--page 0` would wait for a later `/set recall 32`), and recall under a
    policy that never evicts (it would be dropped without a word: nothing ever goes cold)."""
    from ..recall.default import AUTO, is_off
    from ..recall.tiered import RecallConfig

    with user_input():
        RecallConfig.check_options(settings.page, settings.selector, settings.cold_dtype, settings.cold_limit,
                                   settings.recall_every, settings.recall_decode_rule, settings.recall_rest)
        if not is_off(settings.recall) and settings.recall != AUTO and settings.resolved_policy().grows:
            raise ValueError(f"--recall needs a policy that evicts: {settings.policy} keeps every token on the "
                             "device, so nothing would ever be recalled (drop --recall or choose another --policy)")
