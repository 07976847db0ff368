"""Recall by default: what ``--recall auto`` (the default of ``run``, ``story`` and ``generate``) turns
into, and how ``--recall 0`` turns it off.

The rule, from the measurements on SmolLM2-135M (benchmarks/results_recall_amortized.json,
results_recall_default_passkey.json, results_recall_default_perplexity.json):

- at 128 device slots, 64 for the policy and 64 recalling found 5 of 6 pass keys at ~880 tokens where
  the full cache found 5 and h2o alone none; perplexity 18.15 against h2o's 19.52 at the same 128 slots;
  at 256 slots (128 + 128) 1.005x h2o's on the GFDL and 0.990x on Tiny Shakespeare;
- a decode step costs 1.4-1.5x h2o's on the CPU at 2K-8K tokens (choosing pages every step: choosing every
  16th costs ~1.1x but lost the pass key), its device bytes 15% of the KV slots' at 128 slots, fixed.

So: half the device slots recall, in whole pages, once the budget holds at least ``SMALLEST_BUDGET``
slots (below that the measured split leaves the policy too short a window, and nothing was measured);
off for a policy that never evicts (nothing goes cold). The server keeps recall off unless asked
(``serve --recall R``): it halved the load benchmark's tokens/s and took 2.7x the host memory
(results_serve_load_recall.json), a cost every row pays.
"""

from __future__ import annotations

AUTO = "auto"
OFF = ("0", "off", "none")
SMALLEST_BUDGET = 128  # device slots per layer


def is_off(spec) -> bool:
    """No recall: nothing given (a library default), or ``--recall 0`` / ``off``."""
    return spec is None or str(spec).strip().lower() in OFF


def recall_spec(spec, slots: int, page: int, evicts: bool) -> str | None:
    """The --recall to build with for a budget of ``slots`` device slots: ``spec`` as given, None for
    off, and for ``auto`` half the slots in whole ``page``-token pages (None below ``SMALLEST_BUDGET``
    slots, or when the policy keeps every token)."""
    if is_off(spec):
        return None
    if str(spec).strip().lower() != AUTO:
        return str(spec)
    if not evicts or slots < SMALLEST_BUDGET or page < 1:
        return None
    pages = (slots // 2) // page
    return str(pages * page) if pages >= 2 else None
