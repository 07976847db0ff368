"""Server counters and gauges for ``GET /metrics``, rendered by ``prometheus_client``.

The counts are kept here (the engine thread adds to them) and handed to the client library at each
scrape by a custom collector, with the gauges read then from the engine's latest figures: the
library writes the text format (names, HELP and TYPE lines, label escaping)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from .responses import response_id

PREFIX = "h2ochat"
FINISH_REASONS = ("stop", "length", "cancelled", "error")  # always rendered, 0 until one happens


class Metrics:
    """Counters the engine adds to, and gauges read when rendered (``gauges`` returns name ->
    (help, value)). Thread-safe: the engine thread counts, the event loop renders."""

    COUNTERS = {
        "prompt_tokens_total": "Prompt tokens of finished and running requests (the whole conversation).",
        "prompt_tokens_cached_total": "Prompt tokens read from a parked conversation cache instead of fed.",
        "generation_tokens_total": "Tokens generated.",
        "evicted_tokens_total": "Tokens evicted from the KV cache (per layer and KV head, summed).",
        "parked_resumed_total": "Requests that resumed a parked conversation cache.",
    }

    def __init__(self):
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._finished: Counter[str] = Counter()
        self.gauges: Callable[[], dict[str, tuple[str, float]]] = dict
        self._registry = CollectorRegistry(auto_describe=False)  # (one per server: tests make several)
        self._registry.register(self)

    def read_gauges(self, gauges: Callable[[], dict[str, tuple[str, float]]]) -> None:
        """Where the gauges come from when ``/metrics`` is rendered (the engine's latest figures)."""
        self.gauges = gauges

    def add(self, name: str, value: float = 1) -> None:
        if name not in self.COUNTERS:
            raise KeyError(name)
        with self._lock:
            self._counters[name] += value

    def finished(self, reason: str) -> None:
        with self._lock:
            self._finished[reason] += 1

    def collect(self):
        """The metric families of this scrape (``prometheus_client``'s collector interface)."""
        with self._lock:
            counters = dict(self._counters)
            finished = dict(self._finished)
        for name, (text, value) in self.gauges().items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", text, value=value)
        for name, text in self.COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", text, value=counters.get(name, 0))
        family = CounterMetricFamily(f"{PREFIX}_requests_finished_total", "Requests finished, by reason (each "
                                     "choice's reason; a request's is its first choice's).", labels=["reason"])
        for reason in sorted(set(FINISH_REASONS) | set(finished)):
            family.add_metric([reason], finished.get(reason, 0))
        yield family

    def render(self) -> str:
        return generate_latest(self._registry).decode()


def request_line(request, seconds: float, error: str | None = None) -> str:
    """The server log's line for a finished ``request`` (a sequence.Request), as llama-server and vLLM
    log each one: the id its client saw, tokens in (cached: from a parked conversation) and out, the
    tokens its cache evicted (per layer and KV head, summed), how long the engine had it, and each
    choice's finish reason (or the error)."""
    usage = request.usage()
    reasons = ",".join(choice.finish_reason or "?" for choice in request.choices)
    finish = f"error ({error})" if error is not None else reasons
    return (f"request {response_id(request.prepared.params.kind, request.id)}: "
            f"prompt={usage['prompt_tokens']} cached={usage['prompt_tokens_details']['cached_tokens']} "
            f"generated={usage['completion_tokens']} evicted={usage['evicted_tokens']} time={seconds:.2f}s "
            f"finish={finish}")


def parse(text: str) -> dict[str, float]:
    """Prometheus text back to {name (with labels): value} (for tests and the load benchmark)."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            name = sample.name.removeprefix(PREFIX + "_") + (f"{{{labels}}}" if labels else "")
            values[name] = float(sample.value)
    return values
