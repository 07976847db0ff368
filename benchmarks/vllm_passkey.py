"""The held-out pass key through vLLM: vLLM's full cache against vLLM with h2ochat's plugin at a share of the length.

Trials are h2ochat's own (``h2ochat.measure.passkey.make_trials``: a 5-digit key planted at a depth of a filler
text, then the question), built on the held-out texts that ``benchmarks/heldout_texts.py`` writes (none of them
used to tune anything); each configuration runs every trial as one greedy request of ``ANSWER_TOKENS`` tokens
(context and question in one prompt, read in chunks of ``--chunk`` tokens, so that the budget binds while the
prompt is read: the question's chunk attends the kept blocks and itself) in its own process of vLLM's Python
(``benchmarks/vllm_offline.py``), prefix caching off. A hit is h2ochat's ``recalled``. This script runs in
h2ochat's venv. The plugin's settings are recorded as given and as the plugin read them.
usage: vllm_passkey.py --model-dir FOLDER --texts DIR --out FILE [--length 4096] [--share 0.25] [--block-size 128]
       [--chunk 128] [--keys 5] [--depths 0.1,0.5,0.9] [--score-queries 32] [--score-every 1] [--policy h2o:sinks=1]
       [--plugin KEY=VALUE ...] [--configs full,plugin]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import vllm_offline
from json_report import emit

ANSWER_ROOM = 512  # max_model_len beyond --length: the key sentence, the question and the answer


def trials_of(args, tokenizer) -> list[dict]:
    from h2ochat.measure.passkey import make_trials

    depths = [float(d) for d in args.depths.split(",")]
    made = []
    for text_file in sorted(Path(args.texts).glob("*.txt")):
        for trial in make_trials(tokenizer, text_file.read_text(), [args.length], depths, args.keys):
            made.append({"text": text_file.name, "depth": trial.depth, "key": trial.key,
                         "prompt": trial.context[0].tolist() + trial.question[0].tolist()})
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    vllm_offline.add_options(parser, length=4096, block_size=128,
                             plugin_help=" (wins over --policy, --score-queries and --score-every)")
    parser.add_argument("--texts", required=True, help="the folder heldout_texts.py wrote")
    parser.add_argument("--out", default=None)
    parser.add_argument("--keys", type=int, default=5, help="trials per text and depth")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--policy", default="h2o:sinks=1", help="the plugin's policy (as --plugin policy=...)")
    parser.add_argument("--score-queries", type=int, default=32,
                        help="the plugin's score_queries (as --plugin score_queries=...)")
    parser.add_argument("--score-every", type=int, default=1, help="the plugin's score_every (as --plugin score_every=...)")
    args = parser.parse_args()
    defaults = {"policy": args.policy, "score_queries": args.score_queries, "score_every": args.score_every}
    try:
        configs, settings = vllm_offline.check_options(args, defaults)
        if not sorted(Path(args.texts).glob("*.txt")):
            raise ValueError(f"--texts {args.texts} holds no .txt files (benchmarks/heldout_texts.py writes them)")
        from transformers import AutoTokenizer

        from h2ochat.measure.passkey import ANSWER_TOKENS, recalled, wilson_interval

        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        trials = trials_of(args, tokenizer)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        runs = vllm_offline.run_configs(args, configs, settings, [t["prompt"] for t in trials],
                                        [ANSWER_TOKENS] * len(trials), max_model_len=args.length + ANSWER_ROOM,
                                        ignore_eos=True)
    except RuntimeError as exc:
        sys.exit(f"vllm_passkey: {exc}")
    results = {}
    for config, run in runs.items():
        answers = [tokenizer.decode(ids, skip_special_tokens=True) for ids in run["answers"]]
        hits = [recalled(t["key"], a) for t, a in zip(trials, answers)]
        by_depth = {}
        for t, hit in zip(trials, hits):
            got = by_depth.setdefault(str(t["depth"]), [0, 0])
            got[0] += hit
            got[1] += 1
        results[config] = {"hits": sum(hits), "trials": len(hits), "rate": sum(hits) / len(hits),
                           "wilson_95": wilson_interval(sum(hits), len(hits)), "by_depth": by_depth,
                           "seconds": run["seconds"], "dtype": run["dtype"], "plugin_read": run["plugin"],
                           "misses": [{"text": t["text"], "depth": t["depth"], "key": t["key"], "answer": a}
                                      for t, a, hit in zip(trials, answers, hits) if not hit][:20]}
    report = {**vllm_offline.recorded(args, configs, settings), "budget_tokens": settings["budget"],
              "texts": sorted(p.name for p in Path(args.texts).glob("*.txt")), "results": results}
    if "full" in results and "plugin" in results and results["full"]["hits"]:
        report["plugin_over_full_hits"] = results["plugin"]["hits"] / results["full"]["hits"]
    emit(report, args.out)


if __name__ == "__main__":
    main()
