"""Recall by default: what ``--recall auto`` (the default of ``run``, ``story``, ``generate`` and ``serve``)
turns into, and how ``--recall 0`` turns it off.

The defaults, the same on every machine (the C kernels change the speed only):

- half of the device slots recall, once the budget holds at least ``SMALLEST_BUDGET`` slots (below that the
  split leaves the policy too short a window, and nothing was measured); off for a policy that never evicts
  (nothing goes cold). At the same slots it finds most of the pass keys the full cache finds where h2o
  alone finds few, on held-out texts too, at a lower perplexity than h2o alone's
  (results_recall_default_passkey.json, results_recall_default_perplexity.json,
  results_recall_heldout_passkey_128.json, results_recall_heldout_passkey_512.json);
- whole pages of 8 tokens (``CacheSettings.page``): more held-out keys than pages of 16 at about the same cost
  (results_recall_heldout_passkey_128_page8_s47.json, results_recall_cost_page8_s47.json);
- a choice of pages every decode step, with the step's own queries (choosing less often, or a step late,
  lost keys: results_recall_amortized.json, results_recall_heldout_passkey_128_s54_question_chunk_*.json);
- the rest of the cold pages attended in prompt chunks (``--recall-rest auto``, ``recall.rest``): keys the
  recalled pages alone missed, at no cost to a decode step
  (results_recall_heldout_passkey_512_rest_bf16_s62.json, results_recall_rest_cost_s62.json). Where the C
  kernel does not run, the torch route computes the same column: a slower prefill, the same tokens.

The cost of a decode step and of a served chat load against h2o alone's, on CPUs with and without
AVX512-BF16: results_recall_cost_*.json and results_serve_recall_load_*.json.
"""

from __future__ import annotations

from ..sizes import parse_share_or_count

AUTO = "auto"
OFF = ("off", "none")  # and any way of writing zero: 0, 0.0
SMALLEST_BUDGET = 128  # device slots per layer
RECALL_FORMS = "a slot count like 64, a share of the budget in [0, 1) like 0.5, auto, or 0 for no recall"


def read_recall(spec) -> str | float | int | None:
    """--recall as written, checked without the budget (which may wait for the model's window):
    None for no recall (nothing given, 0, 0.0, off), ``AUTO``, a share in (0, 1) as a float, or a
    count of at least 1 as an int. ValueError in one line that speaks of what was written."""
    if spec is None:
        return None
    text = str(spec).strip().lower()
    if text in OFF:
        return None
    if text == AUTO:
        return AUTO
    value = parse_share_or_count(text, "--recall", RECALL_FORMS)
    if value == 0:
        return None
    if isinstance(value, float) and not 0 < value < 1:
        raise ValueError(f"--recall {text}: a share of the budget must be in [0, 1) (0.0 is no recall; 1.0 and "
                         "more would leave the policy no slot)")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"--recall {text}: a count of recall slots cannot be negative (0 is no recall)")
    return value


def is_off(spec) -> bool:
    """No recall: nothing given (a library default), or ``--recall 0`` / ``0.0`` / ``off``. A
    --recall that does not read is not off (``read_recall`` says what is wrong with it)."""
    try:
        return read_recall(spec) is None
    except ValueError:
        return False


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
