"""Server counters and gauges, rendered in the Prometheus text format for ``GET /metrics``."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

from .responses import response_id

PREFIX = "h2ochat"


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

    def render(self) -> str:
        lines = []
        with self._lock:
            counters = dict(self._counters)
            finished = dict(self._finished)
        for name, (text, value) in self.gauges().items():
            lines += [f"# HELP {PREFIX}_{name} {text}", f"# TYPE {PREFIX}_{name} gauge", f"{PREFIX}_{name} {_number(value)}"]
        for name, text in self.COUNTERS.items():
            lines += [f"# HELP {PREFIX}_{name} {text}", f"# TYPE {PREFIX}_{name} counter",
                      f"{PREFIX}_{name} {_number(counters.get(name, 0))}"]
        lines += [f"# HELP {PREFIX}_requests_finished_total Requests finished, by reason (each choice's reason; "
                  "a request's is its first choice's).", f"# TYPE {PREFIX}_requests_finished_total counter"]
        for reason in sorted({"stop", "length", "cancelled", "error"} | set(finished)):
            lines.append(f'{PREFIX}_requests_finished_total{{reason="{reason}"}} {_number(finished.get(reason, 0))}')
        return "\n".join(lines) + "\n"


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


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def parse(text: str) -> dict[str, float]:
    """Prometheus text back to {name (with labels): value} (for tests and the load benchmark)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.removeprefix(PREFIX + "_")] = float(value)
    return values
