"""RULER's needle tasks through vLLM: vLLM's full cache against vLLM with h2ochat's plugin at a budget.

The samples are h2ochat's own RULER samples (``h2ochat.measure.ruler.build_samples``: lm-eval's builders,
sample i from seed + i), so the scores compare with ``h2ochat eval --task ruler`` on the same seed: the
same prompt text (lm-eval's input, a space and its answer prefix, no chat template) tokenized the same way
(no special tokens added), up to the task's ``max_gen_toks`` greedy tokens, ending at the end-of-text
token, scored by RULER's ``string_match_all`` on the answer decoded without special tokens. h2ochat's eval
stops an answer once every expected string is in it; the score is the same.

This script runs in h2ochat's venv (lm-eval builds the samples there); each configuration runs in its own
process of vLLM's Python (``benchmarks/vllm_offline.py``), every prompt read in chunks of ``--chunk``
tokens so that the plugin's budget binds while the prompt is read, prefix caching off.
usage: vllm_ruler.py --model-dir FOLDER [--length 1024] [--samples 25] [--tasks niah_single_1,...]
       [--configs full,plugin] [--share 0.25 | --plugin budget=256] [--plugin KEY=VALUE ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys

import vllm_offline
from json_report import emit

NEEDLES = "niah_single_1,niah_multikey_2,niah_multikey_3"
ANSWER_ROOM = 512  # max_model_len beyond --length: the longest answer (128 tokens) with room to spare


def build(args, tokenizer) -> list:
    from h2ochat.measure import ruler

    tasks = ruler.parse_tasks(args.tasks)
    ruler.check_lm_eval()
    return [sample for task in tasks for sample in ruler.build_samples(tokenizer, task, args.length, args.samples,
                                                                        args.seed)]


def scored(samples, answers: dict, tokenizer, budget: int) -> tuple[list[dict], dict]:
    """(every answer's record, its summary per configuration and task with the average over tasks)."""
    from h2ochat.measure import ruler, score_table
    from h2ochat.measure.eval_log import fingerprint

    records = []
    for config, run in answers.items():
        for sample, ids in zip(samples, run["answers"]):
            answer = tokenizer.decode(ids, skip_special_tokens=True)
            records.append({"cache": config, "task": sample.task, "length": sample.length, "sample": sample.index,
                            "budget_slots": budget if config == "plugin" else None,
                            "prompt_digest": fingerprint(sample), "score": ruler.string_match_all(answer, sample.outputs),
                            "answer": answer, "outputs": list(sample.outputs)})
    return records, score_table.summarize(records)


def plugin_over_full(summary: list[dict]) -> dict | None:
    """The plugin's score over the full cache's, per task and for the average (None where the full cache scored 0)."""
    cells = {(c["cache"], c["task"]): c["score"] for c in summary}
    tasks = [task for cache, task in cells if cache == "full"]
    if not tasks or not any(cache == "plugin" for cache, _ in cells):
        return None
    return {task: (round(cells["plugin", task] / cells["full", task], 4) if cells["full", task] else None)
            for task in tasks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    vllm_offline.add_options(parser, length=1024, block_size=32)
    parser.add_argument("--tasks", default=NEEDLES, help=f"RULER tasks, comma-separated (default {NEEDLES})")
    parser.add_argument("--samples", type=int, default=25, help="samples per task")
    parser.add_argument("--seed", type=int, default=0, help="sample i of a task is built from seed + i "
                        "(0: h2ochat eval's default, so its logs score the same prompts)")
    parser.add_argument("--out", default=None, help="the results JSON (printed either way)")
    args = parser.parse_args()
    try:
        configs, settings = vllm_offline.check_options(args)
        if args.samples < 1:
            raise ValueError(f"--samples must be at least 1, got {args.samples}")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        samples = build(args, tokenizer)
    except ValueError as exc:
        parser.error(str(exc))
    prompts = [tokenizer(s.prompt, add_special_tokens=False)["input_ids"] for s in samples]
    try:
        answers = vllm_offline.run_configs(args, configs, settings, prompts, [s.max_new_tokens for s in samples],
                                           max_model_len=args.length + ANSWER_ROOM,
                                           stop_token_ids=[tokenizer.eos_token_id])
    except RuntimeError as exc:
        sys.exit(f"vllm_ruler: {exc}")
    records, summary = scored(samples, answers, tokenizer, settings["budget"])
    report = {**vllm_offline.recorded(args, configs, settings), "tasks": list(dict.fromkeys(s.task for s in samples)),
              "samples": args.samples, "seed": args.seed, "prompt_tokens_max": max(len(p) for p in prompts),
              "summary": summary, "plugin_over_full": plugin_over_full(summary),
              "runs": {config: {"dtype": run["dtype"], "seconds": run["seconds"], "plugin_read": run["plugin"],
                                "ended_by": {reason: run["finish"].count(reason) for reason in sorted(set(run["finish"]))}}
                       for config, run in answers.items()},
              "answers": records}
    emit(report, args.out)


if __name__ == "__main__":
    main()
