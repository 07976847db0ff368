"""A recall server's host memory when one conversation is long and the rest short (issue 34: a served row's
cold store sized by its own length, not the longest row's).

Starts ``h2ochat serve --recall`` with N rows, sends one long chat (a ~2,000-token passage of Tiny
Shakespeare, a long reply) and, while it runs, N - 1 short ones (a line each), all with ``ignore_eos``;
samples the server's RSS and its recall gauges every half second; reports the peak RSS, the RSS growth from
idle, and the gauges at that peak (allocated: every row at the longest row's capacity; written: each row's
own tokens). Run it on two trees to compare (``PYTHONPATH`` picks the tree the server imports).

    OMP_NUM_THREADS=1 python benchmarks/serve_mixed_lengths.py --rows 16 --out FILE
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from json_report import emit

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chat(url: str, text: str, max_tokens: int) -> None:
    body = json.dumps({"model": "smollm2-135m", "messages": [{"role": "user", "content": text}],
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=3600).read()


def gauges(url: str) -> dict:
    found = {}
    for line in urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines():
        if not line.startswith("#") and line.strip():
            name, _, value = line.rpartition(" ")
            found[name.removeprefix("h2ochat_")] = float(value)
    return found


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) * 1024


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--long-chars", type=int, default=8000, help="characters of the long chat's passage")
    parser.add_argument("--long-reply", type=int, default=256)
    parser.add_argument("--short-reply", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    text = next(TEXT.glob("*hakespeare*")).read_text()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "h2ochat.cli", "serve", "--model", "smollm2-135m", "--threads", "1", "--quiet",
               "--budget", "256", "--kv-dtype", "int8", "--recall", "0.5", "--max-sequences", str(args.rows),
               "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        idle = rss(server.pid)
        samples = []
        done = threading.Event()

        def sample():
            while not done.is_set():
                samples.append({"rss": rss(server.pid), **gauges(url)})
                time.sleep(0.5)
        sampler = threading.Thread(target=sample)
        sampler.start()
        long_chat = threading.Thread(target=chat, args=(url, "Summarise:\n" + text[:args.long_chars], args.long_reply))
        long_chat.start()
        time.sleep(8)  # (the long prompt is read first: the stores grow to its length)
        lines = [line for line in text.splitlines() if len(line) > 30]
        shorts = [threading.Thread(target=chat, args=(url, f"Continue this line: {lines[i * 7]}", args.short_reply))
                  for i in range(args.rows - 1)]
        for thread in shorts:
            thread.start()
        for thread in [long_chat, *shorts]:
            thread.join()
        done.set()
        sampler.join()
    finally:
        server.terminate()
        server.wait(timeout=60)
    peak = max(samples, key=lambda s: s["rss"])
    result = {"rows": args.rows, "command": " ".join(command), "idle_rss_bytes": idle, "peak_rss_bytes": peak["rss"],
              "growth_bytes": peak["rss"] - idle,
              "at_peak": {name: peak.get(name) for name in ("recall_cold_host_bytes", "recall_cold_host_bytes_written",
                                                            "parked_bytes", "rows_in_use")},
              "max_allocated_bytes": max(s.get("recall_cold_host_bytes", 0) for s in samples)}
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
