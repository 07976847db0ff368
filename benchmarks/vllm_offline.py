"""Offline vLLM runs for the benchmarks that set vLLM's full cache against h2ochat's vLLM plugin.

A benchmark's parent process (h2ochat's venv: it builds and scores the prompts) hands each configuration
a job, token-id prompts and how long each answer may be, and runs it in a child process of vLLM's own
Python (``--vllm-python``), one child per configuration: vLLM keeps process-wide state (its plugins, its
platform, its engine process), so two engines in one process would not be two clean runs. ``full`` is vLLM
as shipped (``VLLM_PLUGINS=none``); ``plugin`` is vLLM with h2ochat's KV connector, whose settings
are passed through as given (``--plugin KEY=VALUE``, the value read as JSON when it parses), so that an
option the plugin gains needs no change here; ``--share`` sets the budget as a share of the prompt length.
Every answer is greedy. The child imports vLLM's venv as installed (the plugin included), not the
parent's ``PYTHONPATH``.

This module imports nothing beyond the standard library at import time: h2ochat's venv has no vLLM,
and the child runs this file by its path (``python vllm_offline.py JOB OUT``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

CONFIGS = ("full", "plugin")
CONNECTOR = "H2OConnector"
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
KV_CACHE_BYTES = 1 << 30  # ample for these short prompts; a fixed figure so that no run sizes it from free memory
MAX_NUM_SEQS = 16
DEFAULT_SHARE = 0.25


def plugin_setting(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` as (key, value): the value parsed as JSON when it parses (``32``, ``0.5``, ``true``),
    else kept as the string typed (``h2o:sinks=1``)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def budget_of(share: float, length: int) -> int:
    """``share`` of ``length`` tokens, rounded down, counted on the decimal typed (0.29 x 100 is 29, not the
    28 that binary floating point gives)."""
    return math.floor(Fraction(str(share)) * length)


def plugin_settings(pairs, share: float | None, length: int, defaults: dict | None = None) -> dict:
    """The connector's extra config: ``defaults``, then the ``--plugin`` pairs in order (a later one wins),
    and the budget: ``budget`` if given, else ``share`` x ``length`` tokens (``DEFAULT_SHARE`` when neither is
    given)."""
    settings = dict(defaults or {})
    settings.update(dict(pairs or []))
    if "budget" in dict(pairs or []):
        if share is not None:
            raise ValueError("give the budget once: --share or --plugin budget=TOKENS, not both")
    else:
        settings["budget"] = budget_of(DEFAULT_SHARE if share is None else share, length)
    return settings


def parse_configs(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in CONFIGS]
    if not names or unknown:
        raise ValueError(f"--configs takes a comma-separated list of {', '.join(CONFIGS)}, got {text!r}")
    return list(dict.fromkeys(names))


def add_options(parser: argparse.ArgumentParser, *, length: int, block_size: int, plugin_help: str = "") -> None:
    """The options every vLLM benchmark shares: the model, the engine's shape, the configurations and the plugin's
    settings."""
    parser.add_argument("--model-dir", required=True, help="the model's folder (transformers format)")
    parser.add_argument("--length", type=int, default=length, help="prompt tokens")
    parser.add_argument("--configs", default="full,plugin", help="which of full,plugin to run, in this order")
    parser.add_argument("--share", type=float, default=None,
                        help=f"the plugin's budget as a share of --length, rounded down to tokens (default {DEFAULT_SHARE})")
    parser.add_argument("--plugin", action="append", type=plugin_setting, default=[], metavar="KEY=VALUE",
                        help="a setting of the plugin's connector (repeatable; JSON values, else strings), e.g. "
                             "budget=256, policy=h2o:sinks=1, score_queries=32, recall=0.5" + plugin_help)
    parser.add_argument("--block-size", type=int, default=block_size, help="vLLM's KV block in tokens")
    parser.add_argument("--chunk", type=int, default=128,
                        help="prompt tokens a step reads (vLLM's chunked prefill), so the budget binds while it reads")
    parser.add_argument("--dtype", default="auto", help="vLLM's --dtype (auto: what vLLM picks for the model)")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON,
                        help=f"the Python of vLLM's venv, which runs each configuration (default {DEFAULT_VLLM_PYTHON})")


def check_options(args, plugin_defaults: dict | None = None) -> tuple[list[str], dict]:
    """(configurations, the plugin's settings) from the options, or a ``ValueError`` saying what is wrong."""
    configs = parse_configs(args.configs)
    for name, value in (("--length", args.length), ("--block-size", args.block_size), ("--chunk", args.chunk)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if args.share is not None and not 0 < args.share <= 1:
        raise ValueError(f"--share must be in (0, 1], got {args.share}")
    settings = plugin_settings(args.plugin, args.share, args.length, plugin_defaults)
    if args.share is None and "budget" not in dict(args.plugin):
        args.share = DEFAULT_SHARE  # (recorded as the share the budget came from)
    if not Path(args.vllm_python).exists():
        raise ValueError(f"--vllm-python {args.vllm_python} does not exist")
    if not Path(args.model_dir).is_dir():
        raise ValueError(f"--model-dir {args.model_dir} is not a folder")
    return configs, settings


def engine_options(args, max_model_len: int) -> dict:
    """``vllm.LLM``'s keyword arguments, the same for every configuration: prefix caching off (a prompt's
    blocks are its own), prompts read ``--chunk`` tokens a step."""
    return {"max_model_len": max_model_len, "kv_cache_memory_bytes": KV_CACHE_BYTES, "seed": 0,
            "enable_prefix_caching": False, "block_size": args.block_size, "max_num_batched_tokens": args.chunk,
            "enable_chunked_prefill": True, "max_num_seqs": MAX_NUM_SEQS, "dtype": args.dtype}


def run_configs(args, configs: list[str], settings: dict, prompts: list[list[int]], max_tokens: list[int], *,
                max_model_len: int, stop_token_ids: list[int] = (), ignore_eos: bool = False) -> dict:
    """Each configuration's greedy answers to ``prompts`` (token ids; ``max_tokens`` each), one child process
    of ``--vllm-python`` a configuration: {config: {"answers": [token ids], "finish": [reason], "seconds",
    "dtype", "plugin": the settings the plugin read (None for full)}}."""
    job = {"model_dir": str(Path(args.model_dir).resolve()), "engine": engine_options(args, max_model_len),
           "prompts": prompts, "max_tokens": max_tokens, "stop_token_ids": list(stop_token_ids),
           "ignore_eos": ignore_eos}
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for config in configs:
            job_file, out_file = Path(folder) / f"{config}.job.json", Path(folder) / f"{config}.out.json"
            job_file.write_text(json.dumps({**job, "plugin": settings if config == "plugin" else None}))
            child_env = dict(env, VLLM_PLUGINS="none") if config == "full" else env
            start = time.perf_counter()
            done = subprocess.run([args.vllm_python, str(Path(__file__).resolve()), str(job_file), str(out_file)],
                                  env=child_env, cwd=folder)
            if done.returncode:
                raise RuntimeError(f"the {config} configuration's vLLM process exited with {done.returncode} "
                                   "(its log is above)")
            results[config] = {**json.loads(out_file.read_text()), "seconds": round(time.perf_counter() - start, 1)}
    return results


def recorded(args, configs: list[str], settings: dict) -> dict:
    """What a report records of the engine and the plugin, beside its own figures."""
    return {"configs": configs, "length": args.length, "block_size": args.block_size, "chunk": args.chunk,
            "dtype_asked": args.dtype, "share": args.share, "plugin_settings": settings if "plugin" in configs else None,
            "max_num_seqs": MAX_NUM_SEQS, "kv_cache_bytes": KV_CACHE_BYTES, "prefix_caching": False}


def _effective_plugin_settings(settings: dict) -> dict:
    """The settings as the plugin reads them (its defaults filled in, its environment variables applied), and
    where the plugin was imported from."""
    import dataclasses

    try:
        import h2ochat_vllm
        from h2ochat_vllm.settings import read_settings
    except ImportError as exc:
        return {"unread": f"{type(exc).__name__}: {exc}"}
    read = read_settings(settings, None)
    fields = {field.name: getattr(read, field.name) for field in dataclasses.fields(read)}
    return {**fields, "policy": read.policy.label, "source": str(Path(h2ochat_vllm.__file__).parent)}


def child(job_file: str, out_file: str) -> None:
    """One configuration in this process (vLLM's venv): every prompt, greedy, in one ``generate``."""
    job = json.loads(Path(job_file).read_text())
    from vllm import LLM, SamplingParams

    extra = {}
    if job["plugin"] is not None:
        extra["kv_transfer_config"] = {"kv_connector": CONNECTOR, "kv_role": "kv_both",
                                       "kv_connector_extra_config": job["plugin"]}
    llm = LLM(job["model_dir"], skip_tokenizer_init=True, **job["engine"], **extra)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=job["ignore_eos"], detokenize=False,
                             stop_token_ids=job["stop_token_ids"] or None) for n in job["max_tokens"]]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    Path(out_file).write_text(json.dumps({
        "answers": [list(o.outputs[0].token_ids) for o in outputs],
        "finish": [o.outputs[0].finish_reason for o in outputs], "dtype": dtype,
        "plugin": _effective_plugin_settings(job["plugin"]) if job["plugin"] is not None else None}))


if __name__ == "__main__":
    child(*sys.argv[1:3])
