"""vLLM alone against vLLM with h2ochat's plugin, side by side in one run, on the peers' chat load.

Each configuration starts its own `vllm serve` (the same KV memory, the same threads), waits for
/health, runs ../shared/peers/chat_load.py against it, stops it, and the summaries land in one JSON.
usage: vllm_chat_load.py --venv VENV --model-dir FOLDER --out results_vllm_X.json
       [--clients 8 --turns 4] [--budget 1024] [--policy h2o:sinks=1] [--score-queries 0] [--score-every 1] [--kv-gib 1]
       [--recall 0.5]
       [--order plain,plugin]     (a name may come again, e.g. plain,plugin,plugin,plain: alternated runs, each
                                   kept as NAME, NAME#2, ...; the ratio is of the runs' summed tokens and time;
                                   plugin_recall: the plugin with --recall's share of the budget recalling;
                                   plain_all_cores, plugin_all_cores: the same with no core reserved for the
                                   scheduler, the worker's threads bound to every core: VLLM_CPU_NUM_OF_RESERVED_CPU=0)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from json_report import envelope

PEERS = Path(__file__).resolve().parents[1].parent / "shared" / "peers"


def wait_ready(port: int, server: subprocess.Popen, limit: float = 600) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        if server.poll() is not None:
            raise SystemExit(f"vllm serve exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(3)
    raise SystemExit("vllm serve was not ready in time")


def run_one(args, name: str, port: int, log_dir: Path) -> dict:
    command = [str(Path(args.venv) / "bin" / "vllm"), "serve", args.model_dir, "--served-model-name", "smollm2-135m",
               "--max-model-len", "8192", "--port", str(port)]
    if name.startswith("plugin"):
        config = {"budget": args.budget, "policy": args.policy, "score_queries": args.score_queries,
                  "score_every": args.score_every}
        if name.startswith("plugin_recall"):
            config["recall"] = args.recall
        command += ["--kv-transfer-config", json.dumps({"kv_connector": "H2OConnector", "kv_role": "kv_both",
                                                        "kv_connector_extra_config": config})]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib), VLLM_CPU_OMP_THREADS_BIND="auto", HF_HUB_OFFLINE="1")
    if name.startswith("plain"):
        env["VLLM_PLUGINS"] = "none"  # vLLM as shipped: no general plugin loaded
    if name.endswith("_all_cores"):
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"  # the binding vLLM falls to when its reserve does not fit
    log = open(log_dir / f"serve_{name}.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready_s = wait_ready(port, server)
        out = log_dir / f"load_{name}.json"
        subprocess.run([str(Path(args.venv) / "bin" / "python"), str(PEERS / "chat_load.py"), "--base-url",
                        f"http://127.0.0.1:{port}/v1", "--model", "smollm2-135m", "--clients", str(args.clients),
                        "--turns", str(args.turns), "--label", name, "--json", str(out),
                        *(["--prompts", args.prompts] if args.prompts else [])], check=True)
        summary = json.loads(out.read_text())["summary"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        summary["preemptions"] = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                     if line.startswith("vllm:num_preemptions_total"))
    finally:
        server.terminate()
        server.wait(timeout=120)
        log.close()
    text = (log_dir / f"serve_{name}.log").read_text(errors="replace")
    summary.update(server_ready_s=ready_s, command=" ".join(command), errors_in_log=text.count("Traceback"))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--policy", default="h2o:sinks=1")
    parser.add_argument("--score-queries", type=int, default=0)
    parser.add_argument("--score-every", type=int, default=1, help="a one-token step scores at positions multiple of k")
    parser.add_argument("--prompts", default=None, help="chat_load.py's prompts file (make_prompts.py makes 32 x 8)")
    parser.add_argument("--kv-gib", type=float, default=1)
    parser.add_argument("--recall", type=float, default=0.5, help="the recall share of plugin_recall runs")
    parser.add_argument("--order", default="plain,plugin")
    parser.add_argument("--log-dir", default="/tmp/h2ochat_vllm_bench")
    args = parser.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()  # other jobs share this machine: the load says how much
    runs, seen = {}, {}
    for i, name in enumerate(args.order.split(",")):
        seen[name] = seen.get(name, 0) + 1
        key = name if seen[name] == 1 else f"{name}#{seen[name]}"
        runs[key] = run_one(args, name, 8110 + i, log_dir)
        runs[key]["load_average_after"] = os.getloadavg()
    result = {"started": started, "argv": sys.argv, "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "runs": runs}

    def rate(name):  # all of a configuration's runs: their tokens over their time
        mine = [run for key, run in runs.items() if key.split("#")[0] == name]
        return sum(r["generated_tokens"] for r in mine) / sum(r["wall_s"] for r in mine)

    for plugin in ("plugin", "plugin_recall"):
        if {"plain", plugin} <= set(runs):
            result[f"{plugin}_over_plain_tok_s"] = rate(plugin) / rate("plain")
            result[f"ttft_p90_{plugin}_vs_plain_s"] = [runs[plugin]["ttft_p90"], runs["plain"]["ttft_p90"]]
    for name in ("plain", "plugin"):
        if {name, f"{name}_all_cores"} <= set(runs):
            result[f"{name}_all_cores_over_{name}_tok_s"] = rate(f"{name}_all_cores") / rate(name)
    Path(args.out).write_text(json.dumps(envelope(result), indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
