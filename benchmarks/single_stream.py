"""Single-stream decode speed of `h2ochat generate` with recall on: eager against compiled step, bf16 and fp32, one
thread, each run a process of its own, alternating; the compiled step's start with and without its artifacts;
and where a one-row decode step's time goes (the profiler's top ops, eager and compiled, recall on and off).

The prompt is the first ``--prompt-chars`` characters of tinyshakespeare.txt, fed raw, and ``--new-tokens`` tokens
are generated past it with --ignore-eos: prompt and reply outgrow the default budget, so recall is on (the run's
record says so). Each way runs ``--repeats`` times, the ways and trees taking turns, so a change in the load hits
them alike: compare ratios of runs side by side, not figures across files. ``--tree LABEL=PATH`` names a checkout
to run (``before=/tmp/main-checkout``); the default is this one. Compiled runs share one inductor folder, warmed
by an untimed run per tree and dtype first (their decode speed is the steady one, after the first step);
``--starts`` times a compiled run in the fresh folder first, then again (the second start).

    python benchmarks/single_stream.py --starts --profile --out benchmarks/results_single_stream.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package
from json_report import emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
WAYS = ("eager", "compiled")
KEPT = ("prompt_tokens", "generated_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "first_decode_step_s",
        "steady_decode_tokens_per_s", "dtype", "threads", "kv_slots", "recall_slots")


def generate(tree: Path, prompt: Path, dtype: str, way: str, new_tokens: int, cache_dir: Path) -> dict:
    """One `h2ochat generate --json` in a process of its own, run from ``tree``; its figures and wall time."""
    command = [sys.executable, "-m", "h2ochat.cli", "generate", "-f", str(prompt), "--raw", "-n", str(new_tokens),
               "--ignore-eos", "--threads", "1", "--dtype", dtype, "--json"] + (["--compile"] if way == "compiled" else [])
    env = {**os.environ, "PYTHONPATH": str(tree), "H2OCHAT_CACHE_DIR": str(cache_dir)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"generate failed in {tree} ({dtype}, {way}):\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout)
    figures = {key: record.get(key) for key in KEPT}
    figures["recall_slots"] = record.get("recall_slots")
    figures["recall_on"] = "recall_left_out" not in record and bool(record.get("recall_slots"))
    figures["process_s"] = round(wall, 1)
    figures["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return figures


def speeds(args, prompt: Path, trees: dict[str, Path], cache_dir: Path) -> list[dict]:
    """Decode speed of every (tree, dtype, way), the combinations taking turns ``--repeats`` times."""
    for label, tree in trees.items():  # untimed: the compiled graphs into the shared folder
        for dtype in args.dtypes:
            if "compiled" in args.ways:
                print(f"warming {label} {dtype} compiled", file=sys.stderr, flush=True)
                generate(tree, prompt, dtype, "compiled", 3, cache_dir)
    rows = []
    for repeat in range(args.repeats):
        for dtype in args.dtypes:
            for way in args.ways:
                for label, tree in trees.items():
                    figures = generate(tree, prompt, dtype, way, args.new_tokens, cache_dir)
                    rows.append({"tree": label, "dtype": dtype, "way": way, "repeat": repeat, **figures})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    """Median decode tokens/s per (tree, dtype, way) (the compiled step's steady speed), and compiled / eager."""
    medians: dict[str, float] = {}
    for row in rows:
        key = f"{row['tree']} {row['dtype']} {row['way']}"
        medians.setdefault(key, [])
        speed = row["steady_decode_tokens_per_s"] if row["way"] == "compiled" else row["decode_tokens_per_s"]
        medians[key].append(speed)
    medians = {key: round(statistics.median(values), 2) for key, values in medians.items()}
    ratios = {}
    for key, value in medians.items():
        if key.endswith(" compiled") and key.replace(" compiled", " eager") in medians:
            ratios[key.replace(" compiled", " compiled/eager")] = round(value / medians[key.replace(" compiled", " eager")], 2)
    return {"decode_tokens_per_s_median": medians, "ratios": ratios}


def starts(tree: Path, prompt: Path, dtype: str, new_tokens: int, cache_dir: Path) -> dict:
    """A compiled run in a fresh cache folder, then a second in the same folder: seconds to the first decoded
    token after the prompt (the first decode step: compilation or loading its artifacts, and the step)."""
    if cache_dir.exists():
        raise SystemExit(f"--starts wants a fresh cache folder; {cache_dir} exists")
    first = generate(tree, prompt, dtype, "compiled", new_tokens, cache_dir)
    second = generate(tree, prompt, dtype, "compiled", new_tokens, cache_dir)
    return {"dtype": dtype, "first_start": first, "second_start": second,
            "first_decode_step_s": [first["first_decode_step_s"], second["first_decode_step_s"]]}


def profile_child(dtype: str, prompt: Path, steps: int) -> dict:
    """(In a child process.) The one-row step's time by op, eager and compiled, recall on and off."""
    import torch

    from h2ochat.config import CacheSettings
    from h2ochat.engine.compiled import CompiledDecode
    from h2ochat.engine.forward_step import EagerDecode
    from h2ochat.engine.generation import prefill
    from h2ochat.loading import models

    torch.set_num_threads(1)
    loaded = models.load("smollm2-135m", "cpu", dtype, None, kv_slots=2048)
    ids = loaded.tokenizer(prompt.read_text(), return_tensors="pt").input_ids
    report = {}
    for recall in ("auto", None):
        for way in WAYS:
            cache = CacheSettings(recall=recall).build(loaded.model)
            token = prefill(loaded.model, cache, ids, chunk=512).argmax(-1)
            step = CompiledDecode(loaded.model) if way == "compiled" else EagerDecode(loaded.model)
            for _ in range(4):  # the first compiles (or loads the graph); the rest warm up
                token = step(cache, token).argmax(-1)
            started = time.perf_counter()
            for _ in range(steps):
                token = step(cache, token).argmax(-1)
            ms = (time.perf_counter() - started) / steps * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    token = step(cache, token).argmax(-1)
            events = sorted(prof.key_averages(), key=lambda event: -event.self_cpu_time_total)
            top = [{"op": event.key[:60], "self_ms_per_step": round(event.self_cpu_time_total / steps / 1e3, 2),
                    "calls_per_step": event.count // steps} for event in events[:10]]
            report[f"{way}, recall {'on' if recall else 'off'}"] = {
                "ms_per_step": round(ms, 2), "tokens_per_s": round(1e3 / ms, 1), "top_ops": top}
            print(way, recall, round(ms, 2), file=sys.stderr, flush=True)
    return report


def profile(tree: Path, prompt: Path, dtype: str, steps: int, cache_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "H2OCHAT_CACHE_DIR": str(cache_dir),
           "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor")}
    done = subprocess.run([sys.executable, __file__, "--profile-child", dtype, "--prompt-file", str(prompt),
                           "--profile-steps", str(steps)], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"profile failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH of a checkout to run (default: after=this one)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt-chars", type=int, default=6000)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--starts", action="store_true", help="time a compiled start without and with its artifacts")
    parser.add_argument("--profile", action="store_true", help="the one-row step's top ops (the first tree, bf16)")
    parser.add_argument("--profile-steps", type=int, default=12)
    parser.add_argument("--profile-child", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", type=Path, help="the compiled runs' h2ochat cache folder (default: a fresh one)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.profile_child:
        print(json.dumps(profile_child(args.profile_child, args.prompt_file, args.profile_steps)))
        return 0
    trees = dict(item.split("=", 1) for item in args.tree) or {"after": str(ROOT)}
    trees = {label: Path(path).resolve() for label, path in trees.items()}
    work = Path(tempfile.mkdtemp(prefix="h2ochat-single-"))
    prompt = work / "prompt.txt"
    prompt.write_text(TEXT.read_text()[: args.prompt_chars])
    cache_dir = args.cache_dir or work / "cache"
    report = {"prompt": f"tinyshakespeare.txt[:{args.prompt_chars}] (raw)", "new_tokens": args.new_tokens,
              "threads": 1, "trees": {label: str(path) for label, path in trees.items()}}
    first_tree = next(iter(trees.values()))
    if args.starts:
        report["compile_start"] = starts(first_tree, prompt, args.dtypes[0], 8, cache_dir)
    report["runs"] = speeds(args, prompt, trees, cache_dir)
    report.update(summary(report["runs"]))
    if args.profile:
        report["profile"] = profile(first_tree, prompt, args.dtypes[0], args.profile_steps, cache_dir)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
