#!/usr/bin/env bash
# The committed RULER table: SmolLM2-135M, prompts of 1024 tokens, the five offline tasks,
# rows full, h2o, mean (the best of the other policies at small budgets), h2o with recall as `run` builds
# it (half the slots, pages of 16: eval's --recall 0.5 is run's auto at budgets of 128 and more), and
# h2o with int8 slots, at 12.5%, 25% and 50% of the length. Three invocations share one resumable log
# (eval's rows are a cross product; these are the rows asked for); they run in rounds of ROUND samples
# so that a run cut short has every row on the same samples. Rerun to grow it; finished samples are
# skipped. float32 weights: the model's dtype is part of each sample's digest in the log. The table kept
# is the summary of the log (benchmarks/ruler_summary.py, in the results envelope); each round's own
# --json report is a scratch file.
#   bash benchmarks/ruler_table.sh [SAMPLES=25] [ROUND=5]
set -euo pipefail
cd "$(dirname "$0")/.."
samples=${1:-25}
round=${2:-5}
log=benchmarks/ruler_smollm2_1024.jsonl
common=(--task ruler --model smollm2-135m --dtype float32 --threads 1 --lengths 1024 --budget 0.125,0.25,0.5 --output "$log")
scratch=$(mktemp -d)
for ((k = round; k <= samples; k += round)); do
    h2ochat eval "${common[@]}" --samples "$k" --policies full,h2o,mean --json > "$scratch/plain.json"
    h2ochat eval "${common[@]}" --samples "$k" --policies h2o --recall 0.5 --json > "$scratch/recall.json"
    h2ochat eval "${common[@]}" --samples "$k" --policies h2o --kv-dtype auto,int8 --json > "$scratch/int8.json"
done
python benchmarks/ruler_summary.py "$log" --model smollm2-135m --dtype float32 --length 1024 --samples "$samples" \
    > benchmarks/ruler_smollm2_1024_summary.json
