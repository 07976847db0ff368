"""Recall's settings (``RecallConfig``: --recall, --page, --selector, --cold-dtype, --cold-limit,
--recall-every, checked here once), the --recall reader (``recall_slots``) and what the tier reports
(``TierStats``). The tier itself is ``recall.tier``: ``RecallTier`` per layer, ``RecallSpec`` for a
cache; ``kv.factory.make_cache`` builds a two-tier cache from a ``RecallConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from . import selector_names
from .cold_store import cold_dtype_named
from .default import read_recall
from .two_stage import SUMMARY_CAP


DECODE_RULES = ("in-step", "before")
# --recall-rest: the cold pages not recalled left out (off), or attended as one column (recall.rest) in every
# step (pages) or in prompt chunks only (prompt: a decode step costs what off's does); auto: prompt's on every
# device class. The route computing the rest (the choice's C call where it runs, ``native_choice``; the torch
# route, ``recall.rest``, elsewhere) changes the speed only, never which steps attend it.
REST_MODES = ("auto", "off", "pages", "prompt")
DEFAULT_REST = "auto"  # the product's (CacheSettings.recall_rest; a RecallConfig made by hand attends none)
REST_AUTO = "prompt"  # what auto stands for, on a CPU and on a GPU alike


@dataclass(frozen=True)
class RecallConfig:
    slots: int  # R device slots per (layer, sequence, KV head) for recalled tokens
    page: int = 8  # (CacheSettings.page's default: recall.default says why)
    selector: str = selector_names.AUTO  # see SELECTOR_HELP (resolved by the tier: ``resolved_selector``)
    cold_dtype: str = "auto"
    cold_limit: int | None = None  # tokens per (layer, sequence, KV head) kept in the cold store
    every: int = 1  # decode steps between recalls (prefill chunks always recall)
    # the coded selectors' (intN, rotN) two stages (``summaries``): page summaries on the device, at
    # most this many per (layer, sequence, KV head) (None: one stage, every token's codes on the device)
    summary_cap: int | None = SUMMARY_CAP
    # pages whose token codes the second stage scores (None: two_stage.CANDIDATE_TOKENS' worth of pages)
    candidates: int | None = None
    # when a decode step of a static-shape cache chooses its pages (``chooses_before``): "in-step" with its own
    # queries, as every eager step does (a CPU graph calls the choice as an op: ``graph_choice``), or "before" it
    # with the last step's queries (prefetch, for a captured graph that can call no op back)
    decode_rule: str = "in-step"
    rest: str = "off"  # "pages": the cold pages a step does not recall still attended, one column (recall.rest); auto

    def __post_init__(self):
        self.check_options(self.page, self.selector, self.cold_dtype, self.cold_limit, self.every, self.decode_rule,
                           self.rest)
        if self.slots < 2 * self.page or self.slots % self.page:
            raise ValueError(f"--recall {self.slots} must be a whole number (>= 2) of --page {self.page} pages "
                             "(the last one stages evicted tokens)")
        if self.summary_cap is not None and self.summary_cap < 2:
            raise ValueError(f"the summary cap must be at least 2 summaries, got {self.summary_cap}")
        if self.candidates is not None and self.candidates < 1:
            raise ValueError(f"the second stage must score at least one page, got {self.candidates}")
        if self.cold_limit is not None and self.cold_limit < self.slots:
            raise ValueError(f"--cold-limit {self.cold_limit} must hold at least the {self.slots} recall slots")

    @staticmethod
    def check_options(page: int, selector: str, cold_dtype: str, cold_limit: int | None, every: int,
                      decode_rule: str, rest: str = "off") -> None:
        """The options that do not depend on the slot count, so they can be refused while recall is off
        too (a later --recall would fail on them)."""
        if isinstance(page, bool) or not isinstance(page, int) or page < 1:  # before any `% page`
            raise ValueError(f"--page must be a whole number of tokens >= 1, got {page!r}")
        if cold_limit is not None and cold_limit < 1:
            raise ValueError(f"--cold-limit must be >= 1 token, got {cold_limit}")
        if every < 1:
            raise ValueError(f"--recall-every must be >= 1, got {every}")
        if decode_rule not in DECODE_RULES:
            raise ValueError(f"--recall-decode-rule must be one of {', '.join(DECODE_RULES)}, got {decode_rule!r}")
        if rest not in REST_MODES:
            raise ValueError(f"--recall-rest must be one of {', '.join(REST_MODES)}, got {rest!r}")
        cold_dtype_named(cold_dtype)  # here, not when the first layer allocates mid-run
        _selector_kind(selector)

    @property
    def rest_label(self) -> str:
        """What a row's label adds for ``--recall-rest`` (nothing for the product's default)."""
        if self.rest == DEFAULT_REST:
            return ""
        return ", the rest left out" if self.rest == "off" else f", the rest as {self.rest}"

    @property
    def resolved_rest(self) -> str:
        """The --recall-rest mode the steps follow: ``auto`` is ``REST_AUTO`` whatever the device and whether the C
        kernel runs (the options and the device class decide the tokens; the kernel, the speed)."""
        return REST_AUTO if self.rest == "auto" else self.rest

    def rest_attended(self, decoding: bool) -> bool:
        """Whether a step attends the rest: every step with ``pages``; a prompt chunk (not ``decoding``) with
        ``prompt`` and ``auto``. Computed by the choice's C call where it runs, else by the torch route
        (``recall.rest``: a product of the step's queries with every cold key, slower, the same column up to
        the order of its sums)."""
        mode = self.resolved_rest
        return mode == "pages" or (mode == "prompt" and not decoding)

    def chooses_before(self, device_type: str, captured: bool) -> bool:
        """Whether a static-shape cache's decode step chooses its pages before the step, with the last step's
        queries (prefetch), rather than in the step with its own. In the step wherever the step runs eagerly,
        on a CPU or an accelerator alike, and in a CPU graph (which calls the choice as an op: ``graph_choice``).
        Before it by the "before" rule (``decode_rule``), and where a ``captured`` graph replays the step on an
        accelerator (a CUDA graph's replay runs no Python, so no op can call the choice back; the compiled
        recall step is refused there: ``RecallSpec.compile_blocker``). Choosing a step late lost held-out keys
        (``graph_choice`` cites the measurement): in the step is the default."""
        return self.decode_rule == "before" or (captured and device_type != "cpu")

    @property
    def frames(self) -> int:
        return self.slots // self.page

    @property
    def bits(self) -> int | None:
        """Bits per code of an intN / rotN digest; None for exact (the keys) and quest (page bounds)."""
        kind, bits = _selector_kind(self.selector)
        return bits

    @property
    def rotate(self) -> bool:
        return _selector_kind(self.selector)[0] == "rot"


# the selector names: one list (selector_names.py) for this cache and the masked reference
SELECTOR_HELP = selector_names.SELECTOR_HELP
_selector_kind = selector_names.selector_kind


def recall_slots(spec: str, slots: int) -> int:
    """--recall: a count of slots (64) or a share of the budget written with a point or exponent
    (0.5, 5e-1), read as --budget is (``recall.default.read_recall``), checked against the budget's
    real ``slots``."""
    text = str(spec).strip()
    value = read_recall(text)
    if not isinstance(value, (int, float)):
        raise ValueError(f"--recall {text} names no slot count: it is resolved before the cache is built")
    count = round(value * slots) if isinstance(value, float) else value
    if count < 1:
        raise ValueError(f"--recall {text} of a {slots}-slot budget is less than one slot: give a larger share "
                         "or a count")
    if count >= slots:
        raise ValueError(f"--recall {text} takes all {slots} slots of the budget: leave the policy some "
                         f"(at most {slots - 1}, or a share like 0.5)")
    return count


@dataclass(frozen=True)
class TierStats:
    """The cold tier of a whole cache (every layer, row and KV head), since it was allocated."""

    cold_pages: int  # pages held in the cold stores
    cold_tokens: int  # tokens held in the cold stores
    dropped_tokens: int  # tokens dropped by --cold-limit (oldest pages first)
    host_bytes: int  # cold stores' host memory (allocated)
    digest_device_bytes: int  # the page digests' device memory
    pages_copied: int  # pages brought into recall slots so far
    recalled_mass: float  # attention probability mass the queries gave to recalled tokens
    attended_mass: float  # all the attention mass of the same queries (slots + new tokens)
    staged_tokens: int = 0  # evicted tokens on the staging pages (attended; the cold store takes them next)
    # device bytes of every part of the tier beyond the R recall columns of the budget (which hold the
    # frames' pages and the staging page): what scores pages (``digest_device_bytes``, the same figure),
    # the staging counters, the frames' bookkeeping with the last queries and the statistics
    device_bytes_selector: int = 0
    device_bytes_staging: int = 0
    device_bytes_frames: int = 0
    selector_host_bytes: int = 0  # token-level codes kept beside the cold store (two-stage selectors)
    pages_per_summary: int = 1  # pages each device summary covers (> 1: the cap was reached and it coarsened)
    summary_cap: int | None = None  # device summaries per (layer, sequence, KV head); None: no cap
    host_bytes_written: int = 0  # of ``host_bytes``, the slots the rows have written (what is in memory)

    @property
    def cold_host_bytes(self) -> int:
        return self.host_bytes

    @property
    def device_bytes(self) -> int:
        """Every device byte of the tier beyond its recall columns."""
        return self.device_bytes_selector + self.device_bytes_staging + self.device_bytes_frames

    @property
    def recalled_share(self) -> float:
        """The share of attention that went to recalled tokens."""
        return self.recalled_mass / self.attended_mass if self.attended_mass else 0.0
