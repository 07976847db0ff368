"""Load test of `h2ochat serve`: long chats sent turn after turn through the HTTP API.

Two measurements (issue 16):

1. ``load``: K concurrent chats, each opening with a history several times the budget (text from
   Tiny Shakespeare) and then T short turns, against the server with the h2o policy and against the
   same server with the full policy, both given the same KV memory for their rows (``--kv-memory``):
   output tokens/s, time to first token and inter-token latency (p50/p99), how many chats ran at
   once, peak memory of the server process, requests refused.
2. ``parked``: one chat of many turns on an h2o server: per-turn latency against the turn number
   (a parked chat should cost its new tokens, not its history).
3. ``one_chat`` (issue 23): the README's request (one chat, ``--one-chat-tokens`` tokens) on a server
   of ``--one-chat-rows`` rows against the same request on a 1-row server, both with the default
   budget: the decode time per token of each (the first token excluded: it comes with the prefill)
   and the server's CPU seconds per generated token (one thread: its compute, whatever else loads
   the machine), and their ratios (a decode step runs only the rows in use: close to 1):

    OMP_NUM_THREADS=1 python benchmarks/serve_load.py --phases one_chat --out benchmarks/results_serve_one_chat.json

Replies have a fixed length (``ignore_eos``) and come back with their special tokens
(``skip_special_tokens: false``), so each turn's history is exactly what the model read and both
servers generate the same number of tokens. Run on the CPU with one thread per process:

    OMP_NUM_THREADS=1 python benchmarks/serve_load.py --model smollm2-135m --prefill-chunk 128 \
        --out benchmarks/results_serve_load.json

and on a GPU with a random-weight model (untested there so far):

    python benchmarks/serve_load.py --model opt-6.7b --random-weights --completions --device cuda \
        --budget 0.2 --full-budget 1.0 --kv-memory 40GiB --chats 64 --history-chars 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import httpx2 as httpx

from h2ochat.serve.process import ServerProcess
from json_report import figures, write

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
SOURCE_TEXT: list[str] = []  # the text histories are cut from (--text), read once


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def start_server(args, extra: list[str], log: Path) -> ServerProcess:
    model = ["--random-weights"] if args.random_weights else []
    if args.compile:
        model.append("--compile")
    return ServerProcess(args.model, "--served-model-name", "m", "--max-queue", "1000", "--parked-bytes",
                         args.parked_bytes, "--prefill-chunk", str(args.prefill_chunk),
                         "--prefill-chunks-per-step", str(args.prefill_chunks_per_step), "--device", args.device,
                         "--dtype", args.dtype, *model, *extra, log_path=log)


async def turn(http: httpx.AsyncClient, history: list[dict] | str, args, record: list[dict], turn_number: int) -> str:
    """One streamed turn (a chat's messages, or the whole text so far for /v1/completions); appends its
    timings to ``record``; returns the reply text ('' if refused)."""
    body = {"model": "m", "max_tokens": args.reply, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "skip_special_tokens": False}
    if isinstance(history, str):
        body["prompt"] = history
    else:
        body["messages"] = history
    path = "/v1/completions" if isinstance(history, str) else "/v1/chat/completions"
    while True:
        sent = time.perf_counter()
        first, stamps, text, usage, status = None, [], "", None, None
        async with http.stream("POST", path, json=body) as response:
            status = response.status_code
            if status == 429:
                await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                continue
            if status != 200:
                record.append({"turn": turn_number, "status": status, "error": (await response.aread()).decode()[:300]})
                return ""
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.append({"turn": turn_number, "status": "error event", "error": chunk["error"]["message"]})
                    return ""
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                    if piece:
                        now = time.perf_counter()
                        first = first or now
                        stamps.append(now)
                        text += piece
        done = time.perf_counter()
        record.append({"turn": turn_number, "status": status, "ttft_s": (first or done) - sent, "latency_s": done - sent,
                       "gaps_s": [b - a for a, b in zip(stamps, stamps[1:])], "usage": usage})
        return text


def history_text(rng: random.Random, chars: int) -> str:
    source = SOURCE_TEXT[0]
    start = rng.randrange(0, len(source) - chars)
    return source[start: start + chars]


class Dialogue:
    """One conversation, turn after turn: a chat, or with ``--completions`` one growing text (models
    without a chat template, e.g. ``--random-weights``)."""

    def __init__(self, args, rng: random.Random):
        self.args, self.rng, self.turns = args, rng, 0
        opening = "Read this and answer my questions about it.\n\n" + history_text(rng, args.history_chars)
        self.messages, self.text = [{"role": "user", "content": opening}], opening

    async def turn(self, http: httpx.AsyncClient, record: list[dict], server: ServerProcess | None = None) -> bool:
        """The next turn; False when it was refused or failed. With ``server``, the turn's record
        gets the server's CPU seconds for it (one thread: its compute)."""
        self.turns += 1
        if self.turns > 1:
            said = history_text(self.rng, self.args.user_chars)
            self.messages.append({"role": "user", "content": said})
            self.text += "\n" + said
        cpu = server.cpu_seconds() if server else 0.0
        reply = await turn(http, self.text if self.args.completions else self.messages, self.args, record, self.turns)
        if server:
            record[-1]["cpu_s"] = server.cpu_seconds() - cpu
        self.messages.append({"role": "assistant", "content": reply})
        self.text += reply
        return bool(reply)


async def chat(url: str, args, rng: random.Random, record: list[dict], turns: int,
               server: ServerProcess | None = None) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        dialogue = Dialogue(args, rng)
        for _ in range(turns):
            if not await dialogue.turn(http, record, server):
                return


async def old_against_new(url: str, args, old: Dialogue, server: ServerProcess, pairs: int) -> dict:
    """The long chat's next turns against the second turns of new chats, alternating, so both see
    the same load: (latency, server CPU) of each."""
    records = {"old": [], "new": []}
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        for number in range(pairs):
            young = Dialogue(args, random.Random(args.seed + 1000 + number))
            await young.turn(http, [], server)  # its opening history: not measured
            await young.turn(http, records["new"], server)
            await old.turn(http, records["old"], server)
    return {side: [{"turn": r["turn"], "latency_s": round(r["latency_s"], 3), "server_cpu_s": round(r["cpu_s"], 3),
                    "prompt_tokens": r["usage"]["prompt_tokens"],
                    "cached_tokens": r["usage"]["prompt_tokens_details"]["cached_tokens"]} for r in rows]
            for side, rows in records.items()}


async def watch(server: ServerProcess, stop: asyncio.Event, seen: dict) -> None:
    while not stop.is_set():
        values = await asyncio.to_thread(server.metrics)
        seen["max_running"] = max(seen.get("max_running", 0), values["requests_running"])
        seen["max_waiting"] = max(seen.get("max_waiting", 0), values["requests_waiting"])
        await asyncio.sleep(0.5)


def summarize(records: list[dict], wall_s: float) -> dict:
    served = [r for r in records if r.get("status") == 200]
    gaps = [gap for r in served for gap in r["gaps_s"]]
    later = [r for r in served if r["turn"] > 1]
    tokens = sum(r["usage"]["completion_tokens"] for r in served if r["usage"])
    return {
        "turns_served": len(served),
        "turns_refused": [r for r in records if r.get("status") != 200],
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 2),
        "output_tokens_per_s": round(tokens / wall_s, 2),
        "ttft_p50_s": percentile([r["ttft_s"] for r in served], 0.5),
        "ttft_p99_s": percentile([r["ttft_s"] for r in served], 0.99),
        "ttft_later_turns_p50_s": percentile([r["ttft_s"] for r in later], 0.5),
        "itl_p50_s": percentile(gaps, 0.5),
        "itl_p99_s": percentile(gaps, 0.99),
        "cached_prompt_tokens": sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in served if r["usage"]),
        "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in served if r["usage"]),
        "evicted_tokens": sum(r["usage"]["evicted_tokens"] for r in served if r["usage"]),
    }


def load_phase(args, policy: str, budget: str, log_dir: Path, extra: tuple[str, ...] = (), name: str = "") -> dict:
    name = name or policy
    server = start_server(args, ["--policy", policy, "--budget", budget, "--kv-memory", args.kv_memory, *extra],
                          log_dir / f"serve_{name}.log")
    try:
        server.wait_ready()
        before = server.metrics()
        records: list[dict] = []
        seen: dict = {}

        async def run():
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(server, stop, seen))
            started = time.perf_counter()
            await asyncio.gather(*(chat(server.url, args, random.Random(args.seed + k), records, args.turns)
                                   for k in range(args.chats)))
            wall = time.perf_counter() - started
            stop.set()
            await watcher
            return wall

        wall = asyncio.run(run())
        summary = summarize(records, wall)
        summary.update({
            "policy": policy, "budget": budget, "command": server.command,
            "recalled_pages": sum(r["usage"].get("recalled_pages", 0) for r in records if r.get("usage")),
            "rows": int(before["rows"]), "kv_bytes_reserved": int(before["kv_bytes_reserved"]),
            "max_concurrent_chats": int(seen.get("max_running", 0)), "max_waiting": int(seen.get("max_waiting", 0)),
            "peak_rss_bytes": server.peak_rss(),
        })
        after = server.metrics()  # (the recall tier's figures, where the server has one)
        summary.update({name: int(value) for name, value in after.items() if name.startswith("recall_")})
        summary["parked_bytes"] = int(after["parked_bytes"])
        return summary
    finally:
        server.stop()


def parked_phase(args, log_dir: Path) -> dict:
    server = start_server(args, ["--policy", "h2o", "--budget", args.budget, "--max-sequences", "1"],
                          log_dir / "serve_parked.log")
    try:
        server.wait_ready()
        records: list[dict] = []
        long_chat = Dialogue(args, random.Random(args.seed))

        async def grow():
            async with httpx.AsyncClient(base_url=server.url, timeout=3600) as http:
                for _ in range(args.parked_turns):
                    if not await long_chat.turn(http, records, server):
                        return

        started = time.perf_counter()
        asyncio.run(grow())
        wall = time.perf_counter() - started
        paired = asyncio.run(old_against_new(server.url, args, long_chat, server, args.pairs))
        served = [r for r in records if r.get("status") == 200]
        per_turn = [{"turn": r["turn"], "latency_s": round(r["latency_s"], 3), "ttft_s": round(r["ttft_s"], 3),
                     "server_cpu_s": round(r.get("cpu_s", 0.0), 3),
                     "prompt_tokens": r["usage"]["prompt_tokens"],
                     "cached_tokens": r["usage"]["prompt_tokens_details"]["cached_tokens"]} for r in served]
        by_turn = {r["turn"]: r for r in per_turn}
        last = max(by_turn)
        early = [by_turn[t]["latency_s"] for t in range(2, 7) if t in by_turn]
        late = [by_turn[t]["latency_s"] for t in range(last - 4, last + 1) if t in by_turn]
        early_cpu = [by_turn[t]["server_cpu_s"] for t in range(2, 7) if t in by_turn]
        late_cpu = [by_turn[t]["server_cpu_s"] for t in range(last - 4, last + 1) if t in by_turn]
        return {
            "command": server.command, "turns": last, "wall_s": round(wall, 1), "per_turn": per_turn,
            "turn_2_latency_s": by_turn[2]["latency_s"], f"turn_{last}_latency_s": by_turn[last]["latency_s"],
            "ratio_last_to_turn_2": round(by_turn[last]["latency_s"] / by_turn[2]["latency_s"], 3),
            "median_turns_2_6_s": statistics.median(early), f"median_turns_{last - 4}_{last}_s": statistics.median(late),
            "ratio_medians": round(statistics.median(late) / statistics.median(early), 3),
            "server_cpu_median_turns_2_6_s": statistics.median(early_cpu),
            f"server_cpu_median_turns_{last - 4}_{last}_s": statistics.median(late_cpu),
            "server_cpu_ratio_medians": round(statistics.median(late_cpu) / max(statistics.median(early_cpu), 1e-9), 3),
            "alternating": paired,
            "alternating_latency_ratio_old_to_new": round(
                statistics.median(r["latency_s"] for r in paired["old"])
                / statistics.median(r["latency_s"] for r in paired["new"]), 3),
            "alternating_cpu_ratio_old_to_new": round(
                statistics.median(r["server_cpu_s"] for r in paired["old"])
                / max(statistics.median(r["server_cpu_s"] for r in paired["new"]), 1e-9), 3),
            "peak_rss_bytes": server.peak_rss(),
        }
    finally:
        server.stop()


def one_chat_phase(args, log_dir: Path) -> dict:
    """The README's chat request, alone, on a server of ``--one-chat-rows`` rows and on a 1-row
    server (default budget and policy): seconds per decoded token and server CPU seconds per
    generated token, best of ``--one-chat-repeats`` (the least disturbed by other work on the machine)."""
    prompt = [{"role": "user", "content": "Hello!"}]
    body = {"model": "m", "messages": prompt, "max_tokens": args.one_chat_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    sides = {}
    for rows in (args.one_chat_rows, 1):
        server = start_server(args, ["--max-sequences", str(rows)], log_dir / f"serve_one_chat_{rows}.log")
        try:
            server.wait_ready()
            per_token, cpu_per_token = [], []

            async def once():
                async with httpx.AsyncClient(base_url=server.url, timeout=3600) as http:
                    stamps = []
                    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data: {") and '"content"' in line:
                                stamps.append(time.perf_counter())
                    return stamps

            for _ in range(args.one_chat_repeats):
                cpu = server.cpu_seconds()
                stamps = asyncio.run(once())
                cpu_per_token.append((server.cpu_seconds() - cpu) / len(stamps))
                per_token.append((stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1))
            metrics = server.metrics()
            sides[rows] = {"command": server.command, "rows": int(metrics["rows"]),
                           "kv_bytes_reserved": int(metrics["kv_bytes_reserved"]),
                           "decode_s_per_token": [round(value, 5) for value in per_token],
                           "best_decode_s_per_token": round(min(per_token), 5),
                           "server_cpu_s_per_token": [round(value, 5) for value in cpu_per_token],
                           "best_server_cpu_s_per_token": round(min(cpu_per_token), 5)}
        finally:
            server.stop()
    many, one = sides[args.one_chat_rows], sides[1]
    return {"tokens": args.one_chat_tokens, f"rows_{args.one_chat_rows}": many, "rows_1": one,
            "ratio_many_to_one": round(many["best_decode_s_per_token"] / one["best_decode_s_per_token"], 3),
            "cpu_ratio_many_to_one": round(many["best_server_cpu_s_per_token"] / one["best_server_cpu_s_per_token"], 3)}


def ratio(h2o: float, full: float) -> float | None:
    """h2o against full; None where the full-cache server served nothing (it refuses chats longer
    than its reserved window: that is the comparison's point, not a crash)."""
    return h2o / full if full else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budget", default="128", help="h2o slots per row")
    parser.add_argument("--full-budget", default="1024", help="slots the full-cache server reserves per row")
    parser.add_argument("--kv-memory", default="100MiB", help="KV memory for the rows, the same for both servers")
    parser.add_argument("--parked-bytes", default="2GiB")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--prefill-chunks-per-step", type=int, default=1, help="the servers' option of that name")
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--history-chars", type=int, default=2000, help="opening history (~4 characters a token)")
    parser.add_argument("--user-chars", type=int, default=80)
    parser.add_argument("--reply", type=int, default=16, help="tokens per reply")
    parser.add_argument("--parked-turns", type=int, default=50)
    parser.add_argument("--pairs", type=int, default=5, help="then the long chat's next turns against new chats' "
                        "second turns, alternating, this many of each")
    parser.add_argument("--one-chat-rows", type=int, default=64, help="rows of the large server in one_chat")
    parser.add_argument("--one-chat-tokens", type=int, default=64)
    parser.add_argument("--one-chat-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--phases", default="load,parked", help="load, load_recall (load with a third server: "
                        "h2o with --recall, the same KV memory), parked, one_chat")
    parser.add_argument("--recall", default="32", help="recall slots of the load_recall server (of --budget)")
    parser.add_argument("--completions", action="store_true",
                        help="send each conversation as one growing text to /v1/completions (no chat template)")
    parser.add_argument("--random-weights", action="store_true", help="the model from its configuration "
                        "(e.g. opt-6.7b on a GPU, with --completions: its byte tokenizer has no chat template)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--text", type=Path, default=TEXT, help="where histories and user turns are cut from")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--merge", action="store_true", help="keep what --out holds of the phases not run")
    args = parser.parse_args()
    SOURCE_TEXT.append(args.text.read_text(encoding="utf-8"))
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "h2ochat_serve_load"
    log_dir.mkdir(parents=True, exist_ok=True)
    results = {"args": vars(args) | {"out": str(args.out), "text": str(args.text)}, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               "load_average_before": os.getloadavg()}
    phases = args.phases.split(",")
    if "load" in phases or "load_recall" in phases:
        if "load_recall" in phases:  # (first: the machine's load drifts; the other two come as before)
            results["h2o_recall"] = load_phase(args, "h2o", args.budget, log_dir, ("--recall", args.recall),
                                               name="h2o_recall")
            print(json.dumps({k: v for k, v in results["h2o_recall"].items() if k != "turns_refused"}), flush=True)
        results["h2o"] = load_phase(args, "h2o", args.budget, log_dir)
        print(json.dumps({k: v for k, v in results["h2o"].items() if k != "turns_refused"}), flush=True)
        results["full"] = load_phase(args, "full", args.full_budget, log_dir)
        print(json.dumps({k: v for k, v in results["full"].items() if k != "turns_refused"}), flush=True)
        results["h2o_vs_full"] = {
            "rows": ratio(results["h2o"]["rows"], results["full"]["rows"]),
            "concurrent_chats": ratio(results["h2o"]["max_concurrent_chats"], results["full"]["max_concurrent_chats"]),
            "output_tokens_per_s": ratio(results["h2o"]["output_tokens_per_s"], results["full"]["output_tokens_per_s"]),
        }
        print(json.dumps(results["h2o_vs_full"]), flush=True)
        if "h2o_recall" in results:
            recall, plain = results["h2o_recall"], results["h2o"]
            results["recall_vs_h2o"] = {
                "rows": ratio(recall["rows"], plain["rows"]),
                "concurrent_chats": ratio(recall["max_concurrent_chats"], plain["max_concurrent_chats"]),
                "output_tokens_per_s": ratio(recall["output_tokens_per_s"], plain["output_tokens_per_s"]),
                "peak_rss_bytes": ratio(recall["peak_rss_bytes"], plain["peak_rss_bytes"]),
            }
            results["recall_vs_full"] = {
                "concurrent_chats": ratio(recall["max_concurrent_chats"], results["full"]["max_concurrent_chats"]),
                "output_tokens_per_s": ratio(recall["output_tokens_per_s"], results["full"]["output_tokens_per_s"]),
            }
            print(json.dumps({"recall_vs_h2o": results["recall_vs_h2o"], "recall_vs_full": results["recall_vs_full"]}),
                  flush=True)
    if "parked" in phases:
        results["parked"] = parked_phase(args, log_dir)
        print(json.dumps({k: v for k, v in results["parked"].items() if k != "per_turn"}), flush=True)
    if "one_chat" in phases:
        results["one_chat"] = one_chat_phase(args, log_dir)
        print(json.dumps(results["one_chat"]), flush=True)
    results["load_average_after"] = os.getloadavg()
    if args.out and args.out.exists() and args.merge:  # keep the phases not run this time (in a new envelope)
        results = {**figures(args.out), **results}
    if args.out:
        write(results, args.out)


if __name__ == "__main__":
    main()
