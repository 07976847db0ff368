"""The held-out pass key through vLLM: vLLM's full cache against vLLM with h2ochat's plugin at a share of the length.

Trials are h2ochat's own (``h2ochat.measure.passkey.make_trials``: a 5-digit key planted at a depth of a filler
text, then the question), built on the held-out texts that ``benchmarks/heldout_texts.py`` writes (none of them
used to tune anything); each configuration runs every trial as one greedy request of ``ANSWER_TOKENS`` tokens
(context and question in one prompt, read in chunks of ``--chunk`` tokens, so that the budget binds while the
prompt is read: the question's chunk attends the kept blocks and itself) in its own vLLM process, prefix caching
off. A hit is h2ochat's
``recalled``. The plugin runs H2O without recall (recall through vLLM's offload tier is not built).
usage: vllm_passkey.py --model-dir FOLDER --texts DIR --out FILE [--length 4096] [--share 0.25] [--block-size 128] [--chunk 128] [--keys 5]
       [--depths 0.1,0.5,0.9] [--score-queries 32] [--score-every 1] [--configs full,plugin]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from json_report import emit

def trials_of(args) -> list[dict]:
    from transformers import AutoTokenizer

    from h2ochat.measure.passkey import make_trials

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    depths = [float(d) for d in args.depths.split(",")]
    made = []
    for text_file in sorted(Path(args.texts).glob("*.txt")):
        for trial in make_trials(tokenizer, text_file.read_text(), [args.length], depths, args.keys):
            made.append({"text": text_file.name, "depth": trial.depth, "key": trial.key,
                         "prompt": trial.context[0].tolist() + trial.question[0].tolist()})
    return made


def run_config(args, config: str, trials: list[dict]) -> list[str]:
    """Every trial's answer under one configuration, in this process (a fresh one per configuration)."""
    if config == "full":
        os.environ["VLLM_PLUGINS"] = "none"  # vLLM exactly as shipped
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from h2ochat.measure.passkey import ANSWER_TOKENS

    extra = {}
    if config == "plugin":
        budget = int(args.share * args.length)
        settings = {"budget": budget, "policy": args.policy, "score_queries": args.score_queries,
                    "score_every": args.score_every}
        extra["kv_transfer_config"] = {"kv_connector": "H2OConnector", "kv_role": "kv_both",
                                       "kv_connector_extra_config": settings}
    llm = LLM(args.model_dir, max_model_len=args.length + 512, kv_cache_memory_bytes=1 << 30, seed=0,
              enable_prefix_caching=False, block_size=args.block_size, max_num_batched_tokens=args.chunk,
              enable_chunked_prefill=True, max_num_seqs=16, **extra)
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": t["prompt"]} for t in trials], params, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    return [tokenizer.decode(list(o.outputs[0].token_ids), skip_special_tokens=True) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--texts", required=True, help="the folder heldout_texts.py wrote")
    parser.add_argument("--out", default=None)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's KV block (128 by default on the CPU)")
    parser.add_argument("--keys", type=int, default=5, help="trials per text and depth")
    parser.add_argument("--chunk", type=int, default=128, help="prompt tokens a step reads (vLLM's chunked prefill)")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--policy", default="h2o:sinks=1")
    parser.add_argument("--score-queries", type=int, default=32)
    parser.add_argument("--score-every", type=int, default=1)
    parser.add_argument("--configs", default="full,plugin")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (a child: one configuration)
    parser.add_argument("--trials-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        trials = json.loads(Path(args.trials_file).read_text())
        Path(args.trials_file + f".{args.one}").write_text(json.dumps(run_config(args, args.one, trials)))
        return
    from h2ochat.measure.passkey import recalled, wilson_interval

    trials = trials_of(args)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        trials_file = str(Path(folder) / "trials.json")
        Path(trials_file).write_text(json.dumps(trials))
        for config in args.configs.split(","):
            start = time.perf_counter()
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", config, "--trials-file", trials_file],
                           check=True)
            answers = json.loads(Path(f"{trials_file}.{config}").read_text())
            hits = [recalled(t["key"], a) for t, a in zip(trials, answers)]
            by_depth = {}
            for t, hit in zip(trials, hits):
                got = by_depth.setdefault(str(t["depth"]), [0, 0])
                got[0] += hit
                got[1] += 1
            results[config] = {"hits": sum(hits), "trials": len(hits), "rate": sum(hits) / len(hits),
                               "wilson_95": wilson_interval(sum(hits), len(hits)), "by_depth": by_depth,
                               "seconds": time.perf_counter() - start,
                               "misses": [{"text": t["text"], "depth": t["depth"], "key": t["key"], "answer": a}
                                          for t, a, hit in zip(trials, answers, hits) if not hit][:20]}
    report = {"length": args.length, "share": args.share, "budget_tokens": int(args.share * args.length),
              "block_size": args.block_size, "chunk": args.chunk, "policy": args.policy, "score_queries": args.score_queries,
              "score_every": args.score_every, "recall": "none (not built through vLLM's offload tier)",
              "texts": sorted(p.name for p in Path(args.texts).glob("*.txt")), "results": results}
    if "full" in results and "plugin" in results and results["full"]["hits"]:
        report["plugin_over_full_hits"] = results["plugin"]["hits"] / results["full"]["hits"]
    emit(report, args.out)


if __name__ == "__main__":
    main()
