"""Recall by default: what ``--recall auto`` (the default of ``run``, ``story``, ``generate`` and ``serve``)
turns into, and how ``--recall 0`` turns it off.

The rule, from the measurements on SmolLM2-135M (benchmarks/results_recall_amortized.json,
results_recall_default_passkey.json, results_recall_default_perplexity.json):

- at 128 device slots, 64 for the policy and 64 recalling found 5 of 6 pass keys at ~880 tokens where
  the full cache found 5 and h2o alone none; perplexity 18.15 against h2o's 19.52 at the same 128 slots;
  at 256 slots (128 + 128) 1.005x h2o's on the GFDL and 0.990x on Tiny Shakespeare;
- a decode step costs 1.4-1.5x h2o's on the CPU at 2K-8K tokens (choosing pages every step: choosing every
  16th costs ~1.1x but lost the pass key), its device bytes 15% of the KV slots' at 128 slots, fixed.

- on four held-out texts it was not tuned on (GPL-3, man bash, stdlib docstrings, idlelib NEWS2x;
  results_recall_heldout_passkey_128.json, issue 34), 128 slots at ~900 tokens, 60 trials a row: the
  split found 41 keys, the full cache 44 (93% of it), h2o alone 0; at 512 slots (~3,600 tokens) 24
  against the full cache's 27 (89%);
- pages of 8 rather than 16 (session 47, the same 60 trials, the cold store's default format): 45 keys
  at 128 slots against 40 (the full cache 44; every key pages of 16 found, and 5 more), the same 24 at
  512 (every trial's verdict the same), perplexity over 1,000 GFDL tokens 17.97 against 18.11 at 128
  slots and 17.55 against 17.57 at 256 (Tiny Shakespeare 42.52 against 42.62, 40.88 against 40.91);
  a recall step costs about the same at 2K / 128 slots and ~10% more at 4K at the default budget
  (twice the pages, each half as long: results_recall_cost_page8_s47.json). The default budget is not
  measured on held-out text at 7x its slots (past SmolLM2's 8,192 positions); probed at 4.5x (7,400
  tokens, 24 trials a row): recall 9, the full cache 8, h2o alone 4
  (results_recall_heldout_passkey_default_budget_s59.json).
- the rest of the cold pages (``recall.rest``, ``--recall-rest auto``, session 62) is attended in prompt
  chunks where the recall step's C call computes it: at 512 slots, over 180 held-out trials in bf16 (the
  CPU product's dtype), it found 79 keys where the full cache found 84 and recall alone 73; attended in
  decode steps too (``pages``) 83, in decode steps alone (session 61) 72
  (results_recall_heldout_passkey_512_rest_bf16_s62.json); at 128 slots 47 of 60 against the full cache's
  45 (results_recall_heldout_passkey_128_rest_bf16_s62.json). A decode step then costs recall alone's
  (1.12x h2o's at 2K, ``pages`` 1.16x), a prefill 1.20x recall alone's (results_recall_rest_cost_s62.json).
- on a CPU without AVX512-BF16 (an AVX2 EPYC, where ``--dtype auto`` is fp32) the recall step ran the torch
  route until session 63: 1.74x h2o's decode step at 2K; the kernel's portable build (fp32 too, the rest
  included) brings it to 1.04-1.21x, median 1.14x (results_recall_cost_s63_avx2.json), so the same default holds there.

So: half the device slots recall, in whole pages of 8 (``CacheSettings.page``), once the budget holds
at least ``SMALLEST_BUDGET`` slots (below that the measured split leaves the policy too short a window,
and nothing was measured);
off for a policy that never evicts (nothing goes cold). The server takes the same rule since session 69
(``serve``'s --recall is auto too). Under the peers' chat load (8 chats x 4 turns, 8 rows, one thread) a recall
server served 1.24x fewer tokens/s than one without on an AVX512-BF16 CPU (session 59), and on an AVX2 one in
fp32 1.38x (session 64), 1.27-1.31x (sessions 65-68, its fp32 model's cold keys in bf16), then 1.21x over six
pairs at --budget 256 --recall 0.5 (1.12-1.25x) and 1.17x over two at the defaults (--budget 0.2, --recall auto;
1.13x and 1.21x) once the portable kernel's decode choice split each bf16 key in place (session 69:
results_serve_recall_load_s69.json), inside issue 34's 1.25x, at 1.28x and 1.12x the peak RSS (target 1.5x).
(Its decode step runs the smallest bucket of rows since session 64, as the h2o server's does: a lone chat no
longer steps every row.)
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
