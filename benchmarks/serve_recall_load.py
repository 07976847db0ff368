"""`h2ochat serve` with and without recall under the same chat load, back to back in one run (issue 34
item 5): tokens/s, the server's CPU seconds per generated token and its peak RSS, and their ratios.

The load is the peers' client (``/work/shared/peers/chat_load.py``, driven by ``benchmarks/peers.py``:
~300-token user turns, 64-token replies, temperature 0, ``ignore_eos``); both servers get the same
options and rows (``--max-sequences``), one compute thread, and differ by ``--recall`` alone. Runs
alternate (h2o, recall, h2o, recall, ... ``--pairs``) so a change of the machine's load falls on both.
After each load the server's /metrics (parked bytes, the cold stores' bytes) are read.

    OMP_NUM_THREADS=1 python benchmarks/serve_recall_load.py --clients 8 --turns 4 \\
        --out benchmarks/results_serve_recall_load.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package
from peers import MODEL, Engine, Preset, _dist_version, machine, run_load  # noqa: E402
from json_report import write  # noqa: E402

GAUGES = ("parked_bytes", "parked_conversations", "parked_in_rows", "prompt_tokens_cached_total", "parked_resumed_total",
          "recall_cold_host_bytes", "recall_cold_tokens", "rows",
          "recall_pages_per_summary")


def gauges(url: str) -> dict:
    """The server's /metrics gauges this benchmark reports (after the tier's once-a-second refresh)."""
    time.sleep(1.5)
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        short = name.removeprefix("h2ochat_")
        if short in GAUGES:
            found[short] = float(value)
    return {"metrics": found}


def engine(name: str, args, extra: list[str]) -> Engine:
    command = [sys.executable, "-m", "h2ochat.cli", "serve", "--model", MODEL, "--served-model-name", MODEL,
               "--threads", "1", "--max-queue", "1000", "--quiet", "--budget", args.budget, "--kv-dtype", args.kv_dtype,
               "--max-sequences", str(args.rows), *extra]
    return Engine(name, command, version=_dist_version("h2ochat"), python_server=True)


def ratios(runs: list[dict]) -> dict:
    """Recall against h2o: medians over the pairs of tokens/s, CPU s per token and peak RSS."""
    def median(name, key):
        values = [run[key] for run in runs if run["engine"] == name and run.get(key) is not None]
        return statistics.median(values) if values else None
    out = {}
    for key in ("gen_tok_per_s", "server_cpu_s_per_generated_token", "peak_rss_bytes"):
        h2o, recall = median("h2o", key), median("recall", key)
        out[key] = {"h2o": h2o, "recall": recall, "h2o_over_recall" if key == "gen_tok_per_s" else "recall_over_h2o":
                    (round(h2o / recall, 3) if key == "gen_tok_per_s" else round(recall / h2o, 3))
                    if h2o and recall else None}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--budget", default="256")
    parser.add_argument("--kv-dtype", default="int8")
    parser.add_argument("--recall", default="0.5")
    parser.add_argument("--rows", type=int, default=8, help="--max-sequences of both servers")
    parser.add_argument("--recall-arg", action="append", default=[],
                        help="more options of the recall server (repeat): e.g. --recall-arg=--recall-every=16")
    parser.add_argument("--h2o-arg", action="append", default=[],
                        help="more options of the server without recall (repeat): e.g. --h2o-arg=--no-compile")
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--only", choices=("h2o", "recall"), help="run one of the two servers (a profile, a check)")
    parser.add_argument("--profile", action="store_true", dest="profiled",
                        help="sample each server with py-spy during its load (raw stacks beside the run's log)")
    parser.add_argument("--load-timeout", type=float, default=3600)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    preset = Preset(f"chat-{args.clients}x{args.turns}", clients=args.clients, turns=args.turns,
                    reply_tokens=args.reply_tokens)
    args.profile, args.vllm_venv = [preset.name] if args.profiled else [], "/nonexistent"  # (what peers.run_load reads)
    work = Path(tempfile.mkdtemp(prefix="h2ochat-serve-recall-"))
    # (the baseline says --recall 0 itself: it stays the server without recall whatever serve's default)
    engines = [engine("h2o", args, ["--recall", "0", *args.h2o_arg]),
               engine("recall", args, ["--recall", args.recall, *args.recall_arg])]
    engines = [server for server in engines if args.only in (None, server.name)]
    report = {"issue": 34, "machine": machine(), "argv": sys.argv, "preset": preset.name, "runs": [],
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for _ in range(args.pairs):
        for server in engines:
            print(f"serve_recall_load: {server.name} / {preset.name} ...", file=sys.stderr, flush=True)
            report["runs"].append(run_load(server, preset, args, work, after=gauges))
            report["ratios"] = ratios(report["runs"])
            write(report, args.out)  # after every run: a long load keeps what it measured
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write(report, args.out)
    return report


if __name__ == "__main__":
    main()
