"""kvpress's presses on the committed RULER table's own samples (issue 32 item 5), logged as the table is.

kvpress 0.5.5 needs transformers<5.3 and h2ochat 5.17 or later, so this runs in two venvs:

    # 1. h2ochat's venv: the table's samples exactly (lm-eval's builders, the model's tokenizer, seed 0,
    #    sample i from seed+i, the same digests) and the folder of the de-quantized model
    python benchmarks/ruler_kvpress.py --export /tmp/ruler_samples.jsonl --samples 25
    # 2. kvpress's venv (python3 -m venv /work/peers/kvpress; pip install torch==2.13.0
    #    'transformers>=5.2,<5.3' kvpress==0.5.5 'lm_eval[ruler]==0.4.13'): the presses, one thread
    /work/peers/kvpress/bin/python benchmarks/ruler_kvpress.py --samples-file /tmp/ruler_samples.jsonl \\
        --model-dir DIR --per-task 2 --output benchmarks/ruler_kvpress_smollm2_1024.jsonl

Each press compresses the prompt once, in its prefill, to ``budget`` of its tokens (compression_ratio =
1 - budget / prompt tokens), and the answer is then decoded greedily with nothing evicted: the cache
grows by the answer's tokens. h2ochat evicts during decode as well, holding its budget throughout; at
up to 128 answer tokens against budgets of 128-512 that is the gap between the two. The press sees the
whole prompt, question included (it ends the prompt), as h2ochat's chunked prefill does.

The log is h2ochat's (``h2ochat.measure.eval_log``: one JSON line per finished sample, keyed by row, task,
length, sample id and digest; a rerun skips what is there), rows named ``kvpress snapkv @ 0.125``.
The answer stops once every expected string is in it, as the table's do (the score is then 1 whatever
follows); it is scored by lm-eval's RULER ``string_match_all``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h2ochat.measure.eval_log import EvalLog, Eta  # noqa: E402  (stdlib only: it imports in kvpress's venv too)

# as benchmarks/ruler_table.sh runs `h2ochat eval --task ruler` (its --seed defaults to 0)
TABLE = {"model": "smollm2-135m", "dtype": "float32", "length": 1024, "seed": 0}
BUDGETS = ("0.125", "0.25", "0.5")  # shares of the length, as the table's --budget
# two of kvpress's strongest presses that need no calibration or extra pass (kvpress's README and its
# RULER leaderboard: SnapKV and Expected Attention lead the training-free scorers at these ratios)
PRESSES = {"snapkv": "SnapKVPress", "expected": "ExpectedAttentionPress", "knorm": "KnormPress", "tova": "TOVAPress"}


def export(path: Path, samples: int) -> None:
    """The table's samples (h2ochat's venv): one JSON line each, with its digest as the table logs it."""
    import torch

    from h2ochat.measure import ruler
    from h2ochat.measure.eval_log import fingerprint
    from h2ochat.loading.gguf_conversion import converted_gguf_dir
    from h2ochat.loading.sources import resolve
    from h2ochat.loading.models import load

    loaded = load(TABLE["model"], "cpu", TABLE["dtype"])
    dtype = str(next(loaded.model.parameters()).dtype)
    with path.open("w", encoding="utf-8") as out:
        for task in ruler.TASKS:
            for sample in ruler.build_samples(loaded.tokenizer, task, TABLE["length"], samples, TABLE["seed"]):
                out.write(json.dumps({"task": task, "length": sample.length, "sample": sample.index,
                                      "prompt": sample.prompt, "outputs": list(sample.outputs),
                                      "max_new_tokens": sample.max_new_tokens,
                                      "digest": fingerprint((sample, loaded.name, dtype))}) + "\n")
    print(f"{path}: {samples} samples of each of {len(ruler.TASKS)} tasks; the model's folder for --model-dir: "
          f"{converted_gguf_dir(Path(resolve(TABLE['model']).location), torch.float32)}", file=sys.stderr)


def score(answer: str, outputs: list[str]) -> float:
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all

    return float(string_match_all(postprocess_pred([answer]), [list(outputs)]))


def answer(model, tokenizer, press, prompt: str, max_new_tokens: int, outputs: list[str]) -> tuple[str, bool, int]:
    """Greedy answer with the prompt compressed by ``press`` in its prefill (kvpress's own pipeline's
    steps: positions continue from the prompt's length, not from the compressed cache's). Returns the
    answer, whether it stopped once every output was found, and the prompt's tokens."""
    import torch
    from transformers import DynamicCache

    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        out: list[int] = []
        for step in range(max_new_tokens):
            token = int(logits.argmax(dim=-1)[0])
            if token == tokenizer.eos_token_id:
                break
            out.append(token)
            text = tokenizer.decode(out, skip_special_tokens=True)
            if score(text, outputs) == 1.0:
                return text, len(out) < max_new_tokens, ids.shape[1]
            if len(out) < max_new_tokens:
                position = torch.tensor([[ids.shape[1] + step]])
                logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=position,
                               use_cache=True).logits[:, -1]
    return tokenizer.decode(out, skip_special_tokens=True), False, ids.shape[1]


def run(args) -> None:
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    samples = [json.loads(line) for line in Path(args.samples_file).read_text(encoding="utf-8").splitlines()]
    samples = [s for s in samples if s["sample"] < args.per_task]
    presses = [p.strip() for p in args.presses.split(",") if p.strip()]
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    log = EvalLog(args.output)
    # sample by sample, every row on each (as the table runs): a run cut short compares the rows on the same samples
    work = [(s, press, budget) for s in sorted(samples, key=lambda s: (s["sample"], s["task"]))
            for press in presses for budget in budgets]
    keys = [(f"kvpress {press} @ {budget}", s["task"], s["length"], s["sample"], s["digest"]) for s, press, budget in work]
    eta = Eta(len(work), sum(log.done(k) for k in keys))
    for (s, press_name, budget), key in zip(work, keys):
        if log.done(key):
            continue
        slots = int(float(budget) * s["length"])
        prompt_tokens = len(tokenizer(s["prompt"], add_special_tokens=False)["input_ids"])
        ratio = max(0.0, 1.0 - slots / prompt_tokens)
        press = getattr(kvpress, PRESSES[press_name])(compression_ratio=ratio)
        started = time.perf_counter()
        text, early, _ = answer(model, tokenizer, press, s["prompt"], s["max_new_tokens"], s["outputs"])
        record = {"row": key[0], "task": s["task"], "length": s["length"], "sample": s["sample"], "answer": text,
                  "outputs": s["outputs"], "stopped_when_found": early, "score": score(text, s["outputs"]),
                  "seconds": round(time.perf_counter() - started, 2), "digest": s["digest"], "cache": key[0],
                  "budget_slots": slots, "kv_dtype": "auto", "compression_ratio": round(ratio, 4),
                  "prompt_tokens": prompt_tokens, "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else None}
        log.add(record)
        print(f"{eta.step()}: {key[0]}, {s['task']} sample {s['sample']}: score {record['score']:.2f} "
              f"({record['seconds']:.1f} s)", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", type=Path, help="write the table's samples here (h2ochat's venv) and stop")
    parser.add_argument("--samples", type=int, default=25, help="--export: samples per task")
    parser.add_argument("--samples-file", type=Path, help="the exported samples (kvpress's venv)")
    parser.add_argument("--model-dir", help="the model's folder (--export prints it)")
    parser.add_argument("--per-task", type=int, default=2, help="samples 0..N-1 of each task, on every row")
    parser.add_argument("--presses", default="snapkv,expected", help=f"of {', '.join(PRESSES)}")
    parser.add_argument("--budgets", default=",".join(BUDGETS), help="shares of the length")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "ruler_kvpress_smollm2_1024.jsonl")
    args = parser.parse_args()
    if args.export:
        export(args.export, args.samples)
    elif args.samples_file and args.model_dir:
        run(args)
    else:
        parser.error("give --export FILE, or --samples-file and --model-dir")


if __name__ == "__main__":
    main()
