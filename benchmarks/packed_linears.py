"""The bf16 linear forms (``h2ochat.engine.packed_linears``) side by side in one run, on the real model:
transformers' own (plain), packed for oneDNN (alone, without the plain weights a server may keep beside them), and
the row kernel's (``h2ochat_kernels.cpu.row_products``, up to ``MAX_ROWS`` rows; more fall back to the plain
product). First the model's 211 linears at several row counts (CPU time, one thread, interleaved, the median of
the repeats), then ``h2ochat generate`` end to end in the plain and the row form (alternated; the texts are
compared).

    python benchmarks/packed_linears.py --out benchmarks/results_packed_linears.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from h2ochat.loading.models import load
from h2ochat_kernels.cpu import row_products
from h2ochat.engine.packed_linears import (ENVIRONMENT_SWITCH, KEEP_BOTH_SWITCH, PackedLinear, pack_linears,
                                           unpack_linears)
from json_report import emit

FORMS = ("plain", "packed", "row")
# generate decodes one row, so it takes the row form wherever the row kernel runs: its runs compare that with the
# plain form (a one-row model is never packed)
FORM_ENVIRONMENT = {"plain": {ENVIRONMENT_SWITCH: "0"}, "row": {}}


def linear_pass_seconds(model, rows: int, repeats: int) -> float:
    """CPU seconds of one pass over every linear of ``model`` with ``rows`` input rows (the median of ``repeats``)."""
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    inputs = {width: torch.randn(rows, width, dtype=torch.bfloat16) for width in {m.in_features for m in layers}}
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # (the first pass warms the allocator and oneDNN's primitive cache)
            start = time.process_time()
            for layer in layers:
                layer(inputs[layer.in_features])
            times.append(time.process_time() - start)
    return statistics.median(times[1:])


def put_in_form(model, form: str) -> None:
    unpack_linears(model)
    if form == "packed":  # (the packed form alone: its products are what is timed)
        os.environ[KEEP_BOTH_SWITCH] = "0"
        pack_linears(model, row_products.MAX_ROWS + 1)
        del os.environ[KEEP_BOTH_SWITCH]
    elif form == "row":
        pack_linears(model, 1)


def linears_side_by_side(model_name: str, rows: list[int], repeats: int, rounds: int) -> list[dict]:
    model = load(model_name, device="cpu", dtype="bfloat16").model
    forms = FORMS if row_products.available() else FORMS[:2]
    results = []
    for count in rows:
        times = {form: [] for form in forms}
        for _ in range(rounds):  # alternated, so that a change in the machine's load hits every form
            for form in forms:
                put_in_form(model, form)
                times[form].append(linear_pass_seconds(model, count, repeats))
        median = {form: statistics.median(t) for form, t in times.items()}
        result = {"rows": count, **{f"{form}_ms": round(m * 1e3, 2) for form, m in median.items()}}
        result.update({f"{form}_speedup_vs_plain": round(median["plain"] / m, 3) for form, m in median.items()
                       if form != "plain"})
        results.append(result)
        print(results[-1], file=sys.stderr)
    return results


def generate_once(args, form: str) -> dict:
    command = [sys.executable, "-m", "h2ochat.cli", "generate", "--model", args.model, "-f", args.prompt_file,
               "-n", str(args.new_tokens), "--ignore-eos", "--threads", "1", "--dtype", "bfloat16", "--json"]
    env = {**os.environ, **FORM_ENVIRONMENT[form]}
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    return {"prefill_tokens_per_s": report["prefill_tokens_per_s"], "decode_tokens_per_s": report["decode_tokens_per_s"],
            "text": report["text"]}


def generate_side_by_side(args) -> dict:
    runs = {form: [] for form in FORM_ENVIRONMENT if form == "plain" or row_products.available()}
    for _ in range(args.generate_rounds):
        for name in runs:
            runs[name].append(generate_once(args, name))
            print(name, {k: v for k, v in runs[name][-1].items() if k != "text"}, file=sys.stderr)
    summary = {name: {key: round(statistics.median(r[key] for r in rs), 2)
                      for key in ("prefill_tokens_per_s", "decode_tokens_per_s")} for name, rs in runs.items()}
    for form in runs:
        if form != "plain":
            for what in ("decode", "prefill"):
                key = f"{what}_tokens_per_s"
                summary[f"{form}_{what}_speedup_vs_plain"] = round(summary[form][key] / summary["plain"][key], 3)
    summary["same_text"] = {form: len({r["text"] for r in rs}) == 1 and rs[0]["text"] == runs["plain"][0]["text"]
                            for form, rs in runs.items()}
    summary["runs"] = {name: [{k: v for k, v in r.items() if k != "text"} for r in rs] for name, rs in runs.items()}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", default="1,2,4,8,16,64,331")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-file", default=None, help="generate's prompt (default: the peers' first user turn)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--generate-rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.prompt_file is None:
        here = os.path.dirname(os.path.abspath(__file__))
        prompts = os.path.join(here, "..", "..", "shared", "peers", "prompts", "chat_turns_300.json")
        args.prompt_file = os.path.join(os.environ.get("TMPDIR", "/tmp"), "packed_linears_prompt.txt")
        with open(prompts) as f, open(args.prompt_file, "w") as out:
            out.write(json.load(f)["conversations"][0][0])
    report = {
        "command": " ".join(["python", *sys.argv]),
        "machine": {"cpu": platform.processor() or platform.machine(), "logical_cpus": os.cpu_count(),
                    "torch": torch.__version__, "load_average_before": os.getloadavg(),
                    "row_kernel": row_products.why_not() or "available"},
        "unit": "CPU ms per pass over the model's linears (one thread); generate: tokens/s, wall clock",
        "linears": linears_side_by_side(args.model, [int(r) for r in args.rows.split(",")], args.repeats, args.rounds),
        "generate": generate_side_by_side(args),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
