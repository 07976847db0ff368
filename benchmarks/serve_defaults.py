"""`h2ochat serve` at its defaults with the real model: memory idle and after long prompts, and the
start-up time of a first and a second start sharing one compile cache.

    PYTHONPATH=. python benchmarks/serve_defaults.py [--model smollm2-135m] [--prompt-tokens 6000] \
        [--out benchmarks/results_serve_defaults.json]

Each start gets a fresh H2OCHAT_CACHE_DIR of its own run (the GGUF copy and inductor's graphs), the
second start reuses the first's. Start-up is timed to the first 200 from /health, and its CPU
seconds are read too (what a busy machine does not change). Memory is the server's resident set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import urllib.request
from pathlib import Path

from h2ochat.serve.process import ServerProcess
from json_report import envelope


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def post(url: str, body: dict, timeout: float = 900) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def start(model: str, args: list[str], env: dict, log: Path) -> tuple[ServerProcess, float, float]:
    began = time.monotonic()
    server = ServerProcess(model, *args, log_path=log, env=env)
    server.wait_ready(timeout=1200)
    return server, time.monotonic() - began, server.cpu_seconds()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results_serve_defaults.json")
    parser.add_argument("--compile", action="store_true", help="time the compiled step's starts (minutes on a CPU)")
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="h2ochat-serve-defaults-"))
    env = {"H2OCHAT_CACHE_DIR": str(folder / "cache"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env_clean = {key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_CACHE_DIR"}
    os.environ.clear()
    os.environ.update(env_clean)
    record = {"model": options.model, "machine": platform.machine(), "cpus": os.cpu_count(),
              "compile": options.compile, "starts": []}
    args = ["--compile"] if options.compile else ["--no-compile"]
    for attempt in (1, 2):
        server, wall, cpu = start(options.model, args, env, folder / f"serve-{attempt}.log")
        entry = {"start": attempt, "seconds_to_health": round(wall, 1), "cpu_seconds_to_health": round(cpu, 1),
                 "rss_idle_bytes": rss(server.process.pid)}
        if attempt == 1:
            word = "lighthouse keeper writes in the log "  # ~6 tokens
            text = word * (options.prompt_tokens // 6)
            for number in range(options.prompts):
                reply = post(server.url + "/v1/chat/completions",
                             {"model": options.model, "max_tokens": 8,
                              "messages": [{"role": "user", "content": f"{number} {text}"}]})
                entry.setdefault("prompt_tokens", []).append(reply["usage"]["prompt_tokens"])
            entry["rss_after_prompts_bytes"] = rss(server.process.pid)
            entry["peak_rss_bytes"] = server.peak_rss()
        entry["start_up_log"] = [line for line in server.log().splitlines() if "loaded on" in line
                                 or "memory beyond" in line or "compiling" in line]
        server.stop()
        record["starts"].append(entry)
        print(json.dumps(entry, indent=1), flush=True)
    Path(options.out).write_text(json.dumps(envelope(record), indent=1) + "\n")


if __name__ == "__main__":
    main()
