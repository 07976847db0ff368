"""Re-run chosen pass-key trials of results_recall_heldout_passkey_128 (text, depth, window: 900 tokens, keys 5,
seed 0, as recall_rows_passkey.py draws them) with other recall settings: a diagnostic of the misses (issue 34).
Writes one JSON line per (setting, trial) to stdout; the texts are read from /tmp/heldout (heldout_texts.py).
A third argument sets the length the trials were drawn at (those of results_recall_heldout_passkey_512: 3600,
with "budget": 512 in each setting).

    python benchmarks/recall_rerun_trials.py '[["gpl3.txt", 0.5, 0]]' \
        '[{"recall": "0.5", "page": "16", "selector": "exact"}, {"recall": "0.5", "page": "8", "selector": "rot4"}]' \
        >> results_recall_heldout_misses_128.jsonl
"""
import json, sys
from dataclasses import replace
from pathlib import Path
from h2ochat import threads
threads.apply(1)
from h2ochat.measure import evaluation as ev, passkey as pk
from h2ochat.measure.passkey_rows import build_rows
from h2ochat.loading.models import load
wanted = json.loads(sys.argv[1])  # [[text, depth, window], ...]
settings = json.loads(sys.argv[2])  # [{"recall": "0.5", "page": "16", "selector": "exact", "budget": 128}, ...]
loaded = load('smollm2-135m', 'cpu', 'float32')
rows = []
for s in settings:
    recalls = ev.recall_settings(s["recall"], s["page"], selector=s["selector"])
    rows += [r for r in build_rows(["h2o"], [s.get("budget", 128)], recalls) if r.settings.recall]
length = int(sys.argv[3]) if len(sys.argv) > 3 else 900
by_text = {}
for text, depth, window in wanted:
    by_text.setdefault(text, []).append((depth, window))
for text, keys in by_text.items():
    trials = pk.make_trials(loaded.tokenizer, Path('/tmp/heldout', text).read_text(), [length], [0.1, 0.5, 0.9], 5, seed=0)
    trials = [t for t in trials if (t.depth, t.window) in keys]
    for r in pk.run(loaded.model, loaded.tokenizer, trials, rows):
        print(json.dumps({"text": text, "row": r["row"], "depth": r["depth"], "window": r["window"], "length": length,
                          "recalled": r["recalled"], "answer": r["answer"], "exact": r.get("exact_top_pages_found")}), flush=True)
