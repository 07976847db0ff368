"""One GPU acceptance run, no network: the kernel tests compiled on CUDA, the kernel benchmark's
short table, and OPT-6.7B decode (its shipped configuration, random weights, fp16) with h2o at a
20% budget against a full cache and stock transformers, then a verdict against the targets.

    python benchmarks/gpu_check.py --out DIR             # about 8 minutes at most on one H200
    python benchmarks/gpu_check.py --out DIR --dry-run   # the same code path on the CPU, tiny shapes

Writes DIR/gpu_check.json and DIR/gpu_check.md after every step, so whatever ran survives a later
failure or a kill. Each step is timed and isolated: an exception or a timeout is recorded and the
next step runs. Steps:

1. kernels/tests: ``pytest tests/test_kernels.py`` in a subprocess with TRITON_INTERPRET=0 and
   H2OCHAT_TEST_DEVICE=cuda (fp16 and bf16 cases are in the file); its summary and output tail.
2. kernel benchmark: ``benchmarks/bench_kernels.py --quick`` (batch 1 and 16 x 512 and 4096 slots:
   decode bandwidth against the measured copy bandwidth, scoring cost, SDPA + a separate score
   pass, eviction and a prefill chunk) in a subprocess; its JSON and Markdown table.
3. decode: ``h2ochat.benchmark.run`` on OPT-6.7B at batch 1, 8, 32 and contexts 2048, 4096 for
   h2o / full / hf (eager, and compiled where ``BenchPlan`` has a ``compile`` field), peak GPU
   memory, and the largest batch each variant fits in a fixed KV memory cap with its tokens/s.

Imports only what it needs (torch, transformers, h2ochat.models, h2ochat.benchmark): the GPU
machine has no prompt-toolkit, gguf or matplotlib, and pytest only if installed there.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from contextlib import contextmanager
from pathlib import Path

import torch

from h2ochat import benchmark as bm
from h2ochat.budget import parse_budget
from h2ochat.models import build_random, check_memory, config_parameters, pick_dtype, shipped_config

ROOT = Path(__file__).resolve().parents[1]
GIB, MIB = 2**30, 2**20
TARGETS = {
    "kernel_bandwidth": "decode kernel >= 80% of copy bandwidth at batch 16 / 4096 slots",
    "h2o_vs_full_step": "h2o at 20% >= 1.8x faster per decode step than full at batch 32, context 4096",
    "capacity_throughput": ">= 4x tokens/s at each one's largest batch under the same KV memory",
}
THRESHOLDS = {"kernel_bandwidth": 0.80, "h2o_vs_full_step": 1.8, "capacity_throughput": 4.0}


@dataclasses.dataclass(frozen=True)
class Profile:
    """Everything the GPU run and its CPU dry run differ in; the code path is the same."""

    name: str
    device: str
    kernel_env: dict
    kernel_test_args: tuple
    kernel_test_note: str | None
    kernel_test_timeout: int
    kernel_bench_args: tuple
    kernel_bench_timeout: int
    model: str
    dtype: str
    contexts: tuple
    batches: tuple
    variants: tuple
    budget: str
    steps: int
    warmup: int
    kv_cap: int
    max_batch: int
    compiled_batches: tuple
    target_point: tuple  # (context, batch) the step-time target is read at
    budget_s: int  # the whole run's time limit; the decode step stops starting measurements past it


GPU = Profile(
    name="gpu", device="cuda",
    kernel_env={"TRITON_INTERPRET": "0", "H2OCHAT_TEST_DEVICE": "cuda"},
    kernel_test_args=(), kernel_test_note=None, kernel_test_timeout=180,
    kernel_bench_args=("--quick", "--device", "cuda", "--dtype", "fp16", "--reps", "10"), kernel_bench_timeout=120,
    model="opt-6.7b", dtype="float16", contexts=(2048, 4096), batches=(1, 8, 32), variants=("h2o", "full", "hf"),
    budget="0.2", steps=8, warmup=2,
    # 16 GiB of KV at 0.5 MiB a token: h2o (819 slots) fits 40 sequences of 4096 tokens, full 7
    kv_cap=16 * GIB, max_batch=64,
    compiled_batches=(1, 32), target_point=(4096, 32), budget_s=450,
)
DRY = Profile(
    name="dry-run", device="cpu",
    kernel_env={"TRITON_INTERPRET": "1", "H2OCHAT_TEST_DEVICE": "cpu"},
    kernel_test_args=("-k", "test_decode_empty_cache_and_no_scoring or test_evict_strided_buffers"),
    kernel_test_note="dry run: two kernel tests under the Triton interpreter (a -k subset), not compiled",
    kernel_test_timeout=100,
    kernel_bench_args=("--quick", "--device", "cpu", "--reps", "2"), kernel_bench_timeout=100,
    model="opt-125m", dtype="float32", contexts=(64,), batches=(1, 2), variants=("h2o", "full", "hf"),
    budget="0.2", steps=1, warmup=0,
    kv_cap=8 * MIB, max_batch=2,  # h2o fits 8 sequences of 64 tokens, full 1
    compiled_batches=(), target_point=(64, 2), budget_s=300,  # ~1 min on 2 idle cores; a loaded machine must not skip
)


# -- writing the results -------------------------------------------------------------------------

class Report:
    """The run's state, rewritten to DIR/gpu_check.json and DIR/gpu_check.md after every change."""

    def __init__(self, out: Path, profile: Profile):
        self.out = out
        self.started = time.monotonic()
        self.data = {"profile": profile.name, "dry_run": profile is DRY, "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                     "environment": environment(), "steps": {}, "targets": {}}

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def step(self, name: str) -> dict:
        return self.data["steps"].setdefault(name, {"status": "running"})

    def write(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        try:
            summary = markdown(self.data)
        except Exception as exc:  # the JSON must still be written
            summary = f"# h2ochat GPU check\n\nthe summary could not be rendered ({type(exc).__name__}: {exc}); see gpu_check.json"
        for path, text in ((self.out / "gpu_check.json", json.dumps(self.data, indent=2, default=str)),
                           (self.out / "gpu_check.md", summary)):
            partial = path.with_suffix(path.suffix + ".partial")
            partial.write_text(text + "\n")
            partial.replace(path)  # a reader never sees half a file


def environment() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for module in ("transformers", "triton"):
        try:
            info[module] = __import__(module).__version__
        except Exception as exc:  # triton is optional on the CPU
            info[module] = f"unavailable ({type(exc).__name__})"
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except Exception:  # a copy without .git
        info["commit"] = None
    return info


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


@contextmanager
def timed_step(report: Report, name: str):
    """Run a step: its time, and any exception as its status, go into the report, which is written."""
    entry = report.step(name)
    started = time.monotonic()
    report.write()
    try:
        yield entry
        if entry.get("status") == "running":
            entry["status"] = "ok"
    except Exception as exc:  # one failing step must not lose the others
        entry["status"] = "error"
        entry["error"] = first_line(exc)
        entry["traceback_tail"] = traceback.format_exc()[-3000:]
    finally:
        entry["seconds"] = round(time.monotonic() - started, 1)
        report.write()


def run_process(args: list[str], env: dict, timeout: int) -> tuple[int | None, str, str]:
    """(exit code or None on timeout, stdout, stderr) of a subprocess; on timeout its whole process
    group is killed (pytest and the benchmark start children of their own)."""
    child = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        out, err = child.communicate(timeout=timeout)
        return child.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        return None, out or "", err or ""


# -- step 1: kernel tests ---------------------------------------------------------------------------

def junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped from pytest's JUnit XML (the project's -q in addopts makes
    the console quiet enough to drop the summary line)."""
    if not path.is_file():
        return {}
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


def kernel_tests(report: Report, profile: Profile) -> None:
    with timed_step(report, "kernel_tests") as entry:
        args = ["tests/test_kernels.py", "-q", *profile.kernel_test_args]
        entry["command"] = " ".join([*(f"{k}={v}" for k, v in profile.kernel_env.items()),
                                     shlex.join(["python", "-m", "pytest", *args])])
        if profile.kernel_test_note:
            entry["note"] = profile.kernel_test_note
        if importlib.util.find_spec("pytest") is None:
            entry.update(status="skipped", note="pytest is not installed on this machine (pip install pytest)")
            return
        junit = report.out / "kernel_tests.xml"
        junit.unlink(missing_ok=True)
        code, out, err = run_process([sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider",
                                      f"--junitxml={junit}"], profile.kernel_env, profile.kernel_test_timeout)
        entry["exit_code"] = code
        entry["counts"] = junit_counts(junit)
        entry["output_tail"] = (out + err)[-4000:]
        if code is None:
            entry["status"] = f"timeout after {profile.kernel_test_timeout}s"
        elif code != 0 or entry["counts"].get("failed") or entry["counts"].get("errors"):
            entry["status"] = "failed"


# -- step 2: kernel benchmark ---------------------------------------------------------------------

def kernel_bench(report: Report, profile: Profile) -> None:
    with timed_step(report, "kernel_bench") as entry:
        table = report.out / "bench_kernels.md"
        args = [sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), *profile.kernel_bench_args,
                "--markdown", str(table)]
        entry["command"] = shlex.join(["python", "benchmarks/bench_kernels.py", *args[2:]])
        # the benchmark times compiled kernels on CUDA; the interpreter would only slow its CPU path
        env = {"TRITON_INTERPRET": "0"} if profile.device == "cuda" else {}
        code, out, err = run_process(args, env, profile.kernel_bench_timeout)
        entry["exit_code"] = code
        entry["stderr_tail"] = err[-2000:]
        if code is None:
            entry["status"] = f"timeout after {profile.kernel_bench_timeout}s"
            return
        if code != 0:
            entry["status"] = "failed"
            return
        entry["result"] = json.loads(out)
        entry["markdown"] = table.read_text() if table.is_file() else None


# -- step 3: decode on the model ----------------------------------------------------------------------

def plan_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(bm.BenchPlan)}


def decode(report: Report, profile: Profile) -> None:
    with timed_step(report, "decode") as entry:
        entry.update(model=profile.model, weights="random (shipped configuration)", dtype=profile.dtype,
                     device=profile.device, budget=profile.budget, steps=profile.steps, warmup=profile.warmup,
                     kv_memory_cap_bytes=profile.kv_cap, results=[], comparisons=[], capacity=[], skipped=[], errors=[])
        config = shipped_config(profile.model)
        needed = max(profile.contexts) + profile.steps + profile.warmup + 1  # what bm.run checks
        if config.max_position_embeddings < needed:
            # OPT learns 2048 positions: more table rows let 4096-token contexts be timed; a decode
            # step reads one row, so its cost is the same (the table grows by a few tens of MB)
            entry["positions_extended"] = f"max_position_embeddings {config.max_position_embeddings} -> {needed}"
            config.max_position_embeddings = needed
        dtype = pick_dtype(profile.dtype, profile.device)
        check_memory(config_parameters(config), dtype, profile.device, profile.model)
        started = time.monotonic()
        model = build_random(config, dtype, profile.device)
        entry["build_seconds"] = round(time.monotonic() - started, 1)
        entry["weight_bytes"] = bm.weight_bytes(model)
        entry["kv_bytes_per_token"] = bm.kv_bytes_per_slot(model)
        report.write()

        def slots(context: int) -> int:
            return min(parse_budget(profile.budget, context), context)

        def measure(label: str, reserve_s: float, **plan) -> dict | None:
            """One bm.run; skipped (and said so) once the run's time is nearly spent."""
            if report.elapsed() > profile.budget_s - reserve_s:
                entry["skipped"].append(f"{label}: the run's {profile.budget_s}s time limit is near")
                return None
            try:
                return bm.run(model, bm.BenchPlan(budget_slots=slots, **plan))
            except Exception as exc:  # out of memory at one point must not lose the rest
                entry["errors"].append(f"{label}: {first_line(exc)}")
                return None
            finally:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                report.write()

        common = dict(steps=profile.steps, warmup=profile.warmup, variants=profile.variants)
        for context in profile.contexts:
            for batch in profile.batches:
                result = measure(f"context {context} batch {batch}", 20, contexts=[context], batches=[batch],
                                 kv_memory=None, **common)
                if result:
                    entry["peak_memory_scope"] = result["peak_memory_scope"]
                    entry["results"] += result["results"]
                    entry["comparisons"] += result["comparisons"]
        capacity_context = profile.target_point[0]
        result = measure(f"capacity at context {capacity_context}", 20, contexts=[capacity_context], batches=[],
                         kv_memory=profile.kv_cap, max_batch=profile.max_batch, **common)
        if result:
            entry["capacity"] = result["capacity"]

        compiled = entry["compiled"] = {"results": [], "comparisons": []}
        if "compile" not in plan_fields():
            compiled["status"] = "skipped: h2ochat.benchmark.BenchPlan has no compile field in this version"
        elif not profile.compiled_batches:
            compiled["status"] = "skipped: the dry run does not time compiled decode"
        else:
            for batch in profile.compiled_batches:
                result = measure(f"compiled context {capacity_context} batch {batch}", 60, contexts=[capacity_context],
                                 batches=[batch], kv_memory=None, compile=True, steps=profile.steps,
                                 warmup=profile.warmup, variants=[v for v in profile.variants if v != "hf"])
                if result:
                    compiled["results"] += result["results"]
                    compiled["comparisons"] += result["comparisons"]
            compiled["status"] = "ok" if compiled["results"] else "no compiled measurement finished"
        if entry["errors"] or entry["skipped"]:
            entry["status"] = "partial"


# -- verdicts -------------------------------------------------------------------------------------

def verdict(value: float | None, threshold: float, why_missing: str) -> dict:
    if value is None:
        return {"value": None, "threshold": threshold, "verdict": "N/A", "note": why_missing}
    return {"value": round(value, 3), "threshold": threshold, "verdict": "PASS" if value >= threshold else "MISS"}


def evaluate(report: Report, profile: Profile) -> None:
    steps = report.data["steps"]
    bench = (steps.get("kernel_bench") or {}).get("result") or {}
    row = next((r for r in bench.get("decode", []) if r.get("batch") == 16 and r.get("slots") == 4096), None)
    if bench.get("backend") != "triton":
        bandwidth = verdict(None, THRESHOLDS["kernel_bandwidth"], "no Triton kernel timing (CPU backend or the step failed)")
    else:
        bandwidth = verdict(row and row["bw_fraction_of_copy"], THRESHOLDS["kernel_bandwidth"], "batch 16 / 4096 slots not measured")

    dec = steps.get("decode") or {}
    context, batch = profile.target_point
    point = next((c for c in dec.get("comparisons", []) if c["context"] == context and c["batch"] == batch), None)
    step = verdict(point and point.get("speedup_vs_full"), THRESHOLDS["h2o_vs_full_step"],
                   f"h2o and full were not both measured at context {context}, batch {batch}")
    step["at"] = f"context {context}, batch {batch}"

    by_policy = {c["policy"]: c for c in dec.get("capacity", []) if c["context"] == context}
    h2o, full, hf = by_policy.get("h2o", {}), by_policy.get("full", {}), by_policy.get("hf", {})
    ratio = None
    if h2o.get("decode_tokens_per_s") and full.get("decode_tokens_per_s"):
        ratio = h2o["decode_tokens_per_s"] / full["decode_tokens_per_s"]
    capacity = verdict(ratio, THRESHOLDS["capacity_throughput"], "h2o and full were not both measured under the cap")
    capacity["at"] = (f"context {context}, KV cap {profile.kv_cap / GIB:.3g} GiB: h2o batch {h2o.get('measured_batch')}"
                      f" (fits {h2o.get('max_batch')}), full batch {full.get('measured_batch')} (fits {full.get('max_batch')})")
    notes = []
    if h2o.get("decode_tokens_per_s") and hf.get("decode_tokens_per_s"):
        notes.append(f"vs stock transformers {h2o['decode_tokens_per_s'] / hf['decode_tokens_per_s']:.2f}x")
    if h2o and h2o.get("measured_batch", 0) < h2o.get("max_batch", 0):
        notes.append(f"h2o ran below its largest batch (max_batch {profile.max_batch})")
    if notes:
        capacity["note"] = "; ".join(notes)
    targets = {"kernel_bandwidth": bandwidth, "h2o_vs_full_step": step, "capacity_throughput": capacity}
    for name, target in targets.items():
        target["target"] = TARGETS[name]
        if profile is DRY and target["verdict"] != "N/A":
            notes = [target.get("note"), "dry run: tiny CPU shapes, the verdict says nothing about the GPU"]
            target["note"] = "; ".join(n for n in notes if n)
    report.data["targets"] = targets
    report.write()


# -- markdown --------------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(v) for v in row) + " |" for row in rows)]


def _status(entry: dict) -> str:
    return f"status **{entry.get('status', 'not run')}**" + (f", {entry['seconds']} s" if "seconds" in entry else "")


def markdown(data: dict) -> str:
    env, steps = data["environment"], data["steps"]
    lines = [f"# h2ochat GPU check{' (dry run on the CPU)' if data['dry_run'] else ''}", "",
             f"{data['started']}; {env.get('gpu') or 'no GPU'}; torch {env['torch']}, transformers "
             f"{env.get('transformers')}, triton {env.get('triton')}; commit {env.get('commit')}; "
             f"{data.get('elapsed_s', 0)} s so far", ""]

    lines += ["## Targets", ""]
    targets = data.get("targets") or {}
    if targets:
        lines += _table(["target", "measured", "verdict", "where / note"],
                        [[t["target"], "-" if t["value"] is None else f"{t['value']:.3g}", f"**{t['verdict']}**",
                          "; ".join(x for x in (t.get("at"), t.get("note")) if x)] for t in targets.values()])
    else:
        lines.append("not evaluated yet")

    test = steps.get("kernel_tests", {})
    lines += ["", "## 1. Kernel tests", "", _status(test) + (f": `{test['command']}`" if "command" in test else "")]
    if test.get("counts"):
        lines.append("counts: " + ", ".join(f"{v} {k}" for k, v in test["counts"].items()))
    for key in ("note", "error"):
        if test.get(key):
            lines.append(f"{key}: {test[key]}")
    if test.get("output_tail"):
        lines += ["", "```", test["output_tail"][-1500:].strip(), "```"]

    bench = steps.get("kernel_bench", {})
    lines += ["", "## 2. Kernel benchmark", "", _status(bench) + (f": `{bench['command']}`" if "command" in bench else "")]
    if bench.get("markdown"):
        lines += ["", bench["markdown"].strip()]
    elif bench.get("stderr_tail") or bench.get("error"):
        lines += ["", "```", (bench.get("error") or bench["stderr_tail"])[-1500:].strip(), "```"]

    dec = steps.get("decode", {})
    lines += ["", "## 3. Decode", "", _status(dec)]
    if "model" in dec:
        lines.append(f"{dec['model']} ({dec['weights']}), {dec['dtype']} on {dec['device']}, budget {dec['budget']}, "
                     f"{dec['steps']} timed steps after {dec['warmup']}; built in {dec.get('build_seconds', '-')} s; "
                     f"weights {dec.get('weight_bytes', 0) / GIB:.2f} GiB, KV {dec.get('kv_bytes_per_token', 0) / 1024:.0f} "
                     f"KiB per token; peak memory = {dec.get('peak_memory_scope', '-')}")
        if dec.get("positions_extended"):
            lines.append(f"positions extended for the longer contexts: {dec['positions_extended']}")
    for title, block in (("eager", dec), ("compiled", dec.get("compiled") or {})):
        if block.get("results"):
            lines += ["", f"### {title}: ms per decode step (one new token per sequence)", ""]
            lines += _table(["context", "batch", "policy", "KV slots", "ms/step", "tokens/s", "KV GiB", "peak GiB"],
                            [[r["context"], r["batch"], r["policy"], r["kv_slots"], f"{r['ms_per_step']:.2f}",
                              f"{r['decode_tokens_per_s']:.0f}", f"{r['kv_bytes'] / GIB:.2f}",
                              f"{r['peak_memory_bytes'] / GIB:.2f}"] for r in block["results"]])
            fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
            lines += [""] + _table(["context", "batch", "ideal", "h2o vs full", "h2o vs hf"],
                                       [[c["context"], c["batch"], fmt(c.get("ideal_speedup")), fmt(c.get("speedup_vs_full")),
                                         fmt(c.get("speedup_vs_hf"))] for c in block.get("comparisons", [])])
        elif title == "compiled" and block.get("status"):
            lines += ["", f"compiled: {block['status']}"]
    if dec.get("capacity"):
        lines += ["", f"### Largest batch under a {dec.get('kv_memory_cap_bytes', 0) / GIB:.3g} GiB KV cap", ""]
        lines += _table(["context", "policy", "fits", "run at", "tokens/s", "peak GiB"],
                        [[c["context"], c["policy"], c["max_batch"], c["measured_batch"],
                          "-" if c.get("decode_tokens_per_s") is None else f"{c['decode_tokens_per_s']:.0f}",
                          "-" if c.get("peak_memory_bytes") is None else f"{c['peak_memory_bytes'] / GIB:.2f}"]
                         for c in dec["capacity"]])
    for key in ("skipped", "errors"):
        for item in dec.get(key) or []:
            lines.append(f"- {key[:-1] if key == 'errors' else 'skipped'}: {item}")
    if dec.get("error"):
        lines += ["", "```", dec["error"], dec.get("traceback_tail", "")[-1500:].strip(), "```"]
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with tiny shapes (< 2 min)")
    args = parser.parse_args(argv)
    profile = DRY if args.dry_run else GPU
    if profile is GPU and not torch.cuda.is_available():
        print("gpu_check: error: torch sees no CUDA device (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, profile)
    report.write()
    for step in (kernel_tests, kernel_bench, decode):
        step(report, profile)
    evaluate(report, profile)
    print(f"gpu_check: {report.elapsed():.0f} s; results in {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}",
          file=sys.stderr)
    for target in report.data["targets"].values():
        print(f"  {target['verdict']:4}  {target['target']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
