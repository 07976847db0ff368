"""A running `h2ochat serve`'s memory over time: its RSS beside the /metrics gauges that say what it holds
(parked conversations, the recall tier's cold stores, rows in use), every half second, as JSON lines.

Run it beside a load (it waits for the server and follows the first whose command line matches
``--match``), then compare the RSS growth with the held bytes' growth: session 48 found a served recall
load's RSS growing ~550 MB past its cold stores (heap holes left by stores that grow page by page, and a
parked conversation held twice), which ``h2ochat/host_buffers.py`` closed.

    python benchmarks/serve_memory_timeline.py --out timeline.jsonl &
    OMP_NUM_THREADS=1 python benchmarks/serve_recall_load.py --clients 8 --turns 4 --rows 8 --out load.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import urllib.request

GAUGES = ("parked_bytes", "recall_cold_host_bytes", "recall_cold_host_bytes_written", "rows_in_use", "requests_running",
          "requests_waiting")


def server_pid(pattern: str) -> str | None:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    found = [pid for pid in found if pid != str(os.getpid())]  # (a --match pattern also matches this process's own command line)
    return found[0] if found else None


def sample(pid: str) -> dict:
    """RSS of ``pid`` and the server's gauges (its port read from its command line)."""
    with open(f"/proc/{pid}/status") as status:
        rss = int(status.read().split("VmRSS:")[1].split()[0]) * 1024
    with open(f"/proc/{pid}/cmdline") as cmdline:
        command = cmdline.read().split("\0")
    port = command[command.index("--port") + 1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    gauges = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        short = name.removeprefix("h2ochat_")
        if not line.startswith("#") and short in GAUGES:
            gauges[short] = float(value)
    return {"rss_bytes": rss, **gauges}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", default="h2ochat.cli serve.*--recall", help="pgrep -f pattern of the server")
    parser.add_argument("--seconds", type=float, default=900, help="stop after this long")
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--out", required=True, help="JSON lines, one per sample")
    args = parser.parse_args()
    started = time.time()
    with open(args.out, "w") as out:
        while time.time() - started < args.seconds:
            pid = server_pid(args.match)
            if pid is not None:
                try:
                    out.write(json.dumps({"t": round(time.time() - started, 1), **sample(pid)}) + "\n")
                    out.flush()
                except (OSError, ValueError, IndexError):
                    pass  # (the server is starting or gone)
            time.sleep(args.every)


if __name__ == "__main__":
    main()
