"""Host memory of a long story with recall: RSS growth beside what the cold tier reports (issue 34).

One story of --tokens tokens through the two-tier cache (the story command's settings: its opening,
--budget, recall on), in process. Every --every tokens it records the process's RSS above what it held
before the story, the cold tier's reported host bytes (``cold_host_bytes``: every layer's cold store
and token codes), the tokens held cold, and what a full cache's keys and values for the same tokens
would take. Sampling is fixed by --seed; what the model writes does not change what is measured
(bytes per evicted token), only which pages are recalled.

    python benchmarks/recall_host_memory.py --tokens 2500 --budget 256 > benchmarks/results_recall_host_memory.json
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys

import torch

import h2ochat_prompts
from h2ochat import threads
from h2ochat.engine.generation import CacheSettings, Sampling, attention_shape, inference_steps, stream
from h2ochat.loading.models import load
from h2ochat.chat.prompting import encode
from json_report import emit


def rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(r"VmRSS:\s+(\d+)", handle.read()).group(1)) * 1024


def return_freed_memory() -> None:
    """Ask glibc to hand freed heap back, so RSS shows what is held rather than what was once held."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2500)
    parser.add_argument("--budget", default="256")
    parser.add_argument("--recall", default="auto")
    parser.add_argument("--cold-dtype", default="auto")
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: what `story` loads)")
    args = parser.parse_args()

    loaded = load(args.model, "cpu", args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    settings = CacheSettings(policy="h2o", budget=args.budget, recall=args.recall, cold_dtype=args.cold_dtype)
    input_ids = encode(tokenizer, h2ochat_prompts.read("lighthouse", "story"), chat=False)
    heads, head_dim = attention_shape(model.config)
    full_per_token = 2 * model.config.num_hidden_layers * heads * head_dim * model.dtype.itemsize
    cache = settings.build(model)
    sampling = Sampling(temperature=0.7, top_p=0.95, seed=args.seed, repetition_penalty=1.1)

    # a forward first: the weights paged in from the loaded file and the kernels' buffers made, so that
    # the growth measured is the story's, not the model's first touch
    with torch.inference_mode():
        model(input_ids, use_cache=False)
    return_freed_memory()
    before = rss_bytes()
    samples = []
    steps = stream(model, cache, input_ids, max_new_tokens=args.tokens, sampling=sampling)
    for written, _ in enumerate(inference_steps(steps), 1):
        if written % args.every == 0 or written == args.tokens:
            record = cache.tier_record() or {}
            return_freed_memory()
            fed = input_ids.shape[1] + written
            samples.append({"tokens_written": written, "tokens_fed": fed,
                            "rss_growth_bytes": rss_bytes() - before,
                            "cold_host_bytes": record.get("cold_host_bytes", 0),
                            "cold_tokens": record.get("cold_tokens"),
                            "full_cache_kv_bytes": fed * full_per_token})
    first, last = samples[0], samples[-1]
    emit({"model": loaded.name, "dtype": str(model.dtype), "args": vars(args),
                      "threads": threads.current(), "opening_tokens": input_ids.shape[1],
                      "full_cache_bytes_per_token": full_per_token,
                      "rss_growth_within_cold_host_bytes": last["rss_growth_bytes"] <= last["cold_host_bytes"],
                      # (from the first sample on: the growth the story's length makes, allocator warm-up aside)
                      "rss_growth_after_first_sample": last["rss_growth_bytes"] - first["rss_growth_bytes"],
                      "cold_host_bytes_after_first_sample": last["cold_host_bytes"] - first["cold_host_bytes"],
                      "samples": samples}, None)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
