"""The plugin's options: budget, policy and recall, from vLLM's configuration.

Read, in order of precedence, from the environment (``H2OCHAT_VLLM_BUDGET``, ``H2OCHAT_VLLM_POLICY``,
``H2OCHAT_VLLM_RECALL``), the connector's ``kv_connector_extra_config``, and ``--additional-config
'{"h2ochat": {...}}'``. The budget is in tokens per request and is rounded down to whole KV blocks;
the policy is one of h2ochat's (``h2o``, ``mean``, ``decay``, ``tova``, ``sink``, ``local``), with
knobs as in h2ochat (``h2o:sinks=1``), where sinks count blocks here. ``score_queries`` (0 by
default: every query, as H2O) lets only the last k queries of a prompt chunk add their attention, the
observation window SnapKV scores with: a chunk's scoring then costs k rows instead of the chunk's.
``score_every`` (1 by default: every step, as H2O) lets a step that computes one token of a request add its
attention only where that token's position is a multiple of k: decoding then pays for the score pass on one step
in k (prompt chunks always score). The rule depends on the position alone, so it is the same on every
tensor-parallel rank and in the masked reference.

Recall (``recall``, a share of the budget's blocks, 0 by default) keeps evicted blocks in host memory and
gives each request that many recall slots (``cold_blocks``); ``selector`` names h2ochat's page selector that
ranks them, ``recall_memory`` bounds the host bytes of every request's evicted blocks together,
a prompt chunk's last ``recall_queries`` queries choose its recalled blocks, and ``recall_rest`` says whether
they also attend every evicted block (``prompt``, the default, as h2ochat's own recall attends the rest in
prompt chunks) or only the recalled ones (``off``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from h2ochat.policies import Policy, SlotBudget, get_policy
from h2ochat.recall.selector_names import SELECTOR_HELP, selector_names
from h2ochat.sizes import parse_size

from .worker_state import StepOptions

REST_MODES = ("prompt", "off")
DEFAULT_POLICY = "h2o:sinks=1"  # the first block holds the system prompt's start: pinned, as StreamingLLM's sinks


@dataclass(frozen=True)
class Settings:
    budget_tokens: int
    policy: Policy
    score_queries: int = 0  # 0: every query of a step adds its attention (H2O); k: only a step's last k
    score_every: int = 1  # 1: every one-token step adds its attention; k: only those at a position multiple of k
    recall: float = 0.0  # share of the budget for recalled blocks (0: evicted blocks are dropped)
    selector: str = "auto"  # h2ochat's page selector that ranks the cold blocks (auto: exact, on the CPU)
    recall_memory: int = 0  # host bytes for every request's cold blocks together (0: the default bound)
    recall_queries: int = 32  # a prompt chunk's last queries: they choose its recalled blocks (and attend the rest)
    recall_rest: str = "prompt"  # prompt: a chunk's last recall_queries queries attend every cold block; off: not

    def step_options(self) -> StepOptions:
        return StepOptions(self.score_queries, self.score_every, self.recall_queries, self.recall_rest == "prompt")

    def recall_blocks(self, block_size: int) -> int:
        """The recall slots of a request: the recall share of the budget's blocks, rounded down."""
        return int(self.recall * (self.budget_tokens // block_size))

    def blocks(self, block_size: int) -> SlotBudget:
        """The budget's blocks less the recall slots, split by the policy (sinks, heavy, recent; all in blocks)."""
        total = self.budget_tokens // block_size
        recall = self.recall_blocks(block_size)
        if self.recall and not recall:
            raise ValueError(f"h2ochat recall share {self.recall} of a budget of {total} blocks of {block_size} tokens "
                             "is less than one block: raise the budget or the share")
        blocks = total - recall
        least = self.policy.sinks + 2
        if blocks < least:
            raise ValueError(f"h2ochat budget {self.budget_tokens} tokens is {total} blocks of {block_size}"
                             + (f", {recall} of them for recall" if recall else "")
                             + f"; policy {self.policy.label} needs at least {least} blocks ({least * block_size} "
                             "tokens) besides recall")
        return self.policy.split(blocks)


def _pick(key: str, env: str, *sources: dict):
    if os.environ.get(env):
        return os.environ[env]
    for source in sources:
        if source and source.get(key) is not None:
            return source[key]
    return None


def read_settings(connector_extra: dict | None, additional: dict | None) -> Settings:
    """Settings from the connector's extra config and ``additional_config["h2ochat"]``."""
    extra = dict(connector_extra or {})
    more = dict((additional or {}).get("h2ochat") or {})
    budget = _pick("budget", "H2OCHAT_VLLM_BUDGET", extra, more)
    if budget is None:
        raise ValueError("h2ochat: set a budget in tokens (kv_connector_extra_config {\"budget\": 1024}, "
                         "--additional-config '{\"h2ochat\": {\"budget\": 1024}}' or H2OCHAT_VLLM_BUDGET)")
    policy = get_policy(str(_pick("policy", "H2OCHAT_VLLM_POLICY", extra, more) or DEFAULT_POLICY))
    if policy.grows:
        raise ValueError("h2ochat: policy 'full' evicts nothing: leave the connector out instead")
    recall = float(_pick("recall", "H2OCHAT_VLLM_RECALL", extra, more) or 0.0)
    if not 0.0 <= recall < 1.0:
        raise ValueError(f"h2ochat: recall share must be in [0, 1), got {recall}")
    selector = str(_pick("selector", "H2OCHAT_VLLM_SELECTOR", extra, more) or "auto")
    if selector not in selector_names():
        raise ValueError(f"h2ochat: unknown selector {selector!r}; choose {SELECTOR_HELP}")
    memory = _pick("recall_memory", "H2OCHAT_VLLM_RECALL_MEMORY", extra, more)
    recall_memory = parse_size(str(memory), "recall_memory") if memory is not None else default_recall_memory()
    queries = _pick("recall_queries", "H2OCHAT_VLLM_RECALL_QUERIES", extra, more)
    recall_queries = int(queries) if queries is not None else Settings.recall_queries
    if recall_queries < 1:
        raise ValueError(f"h2ochat: recall_queries must be >= 1, got {recall_queries}")
    rest = str(_pick("recall_rest", "H2OCHAT_VLLM_RECALL_REST", extra, more) or "prompt")
    if rest not in REST_MODES:
        raise ValueError(f"h2ochat: recall_rest must be one of {', '.join(REST_MODES)}, got {rest!r}")
    score_queries = int(_pick("score_queries", "H2OCHAT_VLLM_SCORE_QUERIES", extra, more) or 0)
    if score_queries < 0:
        raise ValueError(f"h2ochat: score_queries must be >= 0, got {score_queries}")
    score_every = int(_pick("score_every", "H2OCHAT_VLLM_SCORE_EVERY", extra, more) or 1)
    if score_every < 1:
        raise ValueError(f"h2ochat: score_every must be >= 1, got {score_every}")
    return Settings(int(budget), policy, score_queries, score_every, recall, selector, recall_memory, recall_queries,
                    rest)


def default_recall_memory() -> int:
    """Half the host memory free now, at most h2ochat's default bound on cold stores (as h2ochat serve's
    --recall-memory when not given)."""
    from h2ochat.host_memory import free_host_bytes
    from h2ochat.recall.cold_bound import DEFAULT_LIMIT

    return min(DEFAULT_LIMIT, free_host_bytes() // 2)
