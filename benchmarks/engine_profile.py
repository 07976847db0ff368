"""Where a server's engine thread spends a load, from a py-spy raw profile of the server's process: the share of
the engine thread's samples in each part of its work (the compiled decode step, the mixed steps' linears,
attention kernel, recall bookkeeping and other Python, prefill steps, waiting for work, the rest).

Record the profile during a load (idle samples included, so waiting shows), then classify it:

    taskset -c 0,1 h2ochat serve --model smollm2-135m --threads 2 --kv-memory 1GiB &
    py-spy record --pid PID --rate 50 --idle --nonblocking --format raw --output chat.raw   # during the load
    python benchmarks/engine_profile.py chat.raw --load-json load.json --out benchmarks/results_….json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package
from json_report import emit  # noqa: E402

ENGINE = "Engine._run"
LOADING = "load_engine"


def part_of(stack: str) -> str:
    """The part of the engine's work one sample of its thread is in (frames joined by ';', outermost first)."""
    if "_drain" in stack:
        return "waiting for work"
    if "_decode_step" in stack:
        if "Runner.call" in stack:
            return "compiled decode step (its graph, attention op and linears inside)"
        return "decode steps around the graph (guards, position ids, recall bookkeeping, sampling)"
    if "_mixed_step" in stack:
        if "_onednn_product" in stack or "row_products" in stack:
            return "mixed steps: linear layers"
        if "attention_ops" in stack:
            return "mixed steps: attention kernel (chunk and rows)"
        if "/recall/" in stack:
            return "mixed steps: recall bookkeeping (Python)"
        return "mixed steps: other (layers, norms, rotary, cache bookkeeping in Python)"
    if "_prefill_step" in stack:
        return "prompt chunks alone"
    return "other engine work (row moves, gauges)"


def classify(raw: Path) -> tuple[int, dict[str, float]]:
    """(the engine thread's samples after loading, each part's share of them)."""
    parts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if ENGINE not in stack or LOADING in stack:
            continue
        parts[part_of(stack)] += int(count)
    total = sum(parts.values())
    return total, {part: round(count / total, 3) for part, count in parts.most_common()} if total else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path, help="py-spy --format raw output")
    parser.add_argument("--load", default="", help="the load, in words")
    parser.add_argument("--load-json", type=Path, help="chat_load.py --json of the load (its summary is kept)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    samples, share = classify(args.raw)
    figures = {"load": args.load, "engine_thread_samples": samples, "engine_thread_share": share}
    if args.load_json:
        summary = json.loads(args.load_json.read_text())["summary"]
        figures["load_result"] = {key: summary[key] for key in ("gen_tok_per_s", "wall_s", "ttft_p50", "itl_p50")}
    emit(figures, args.out, what="Where a server's engine thread spends a load (py-spy samples, idle included)")


if __name__ == "__main__":
    main()
