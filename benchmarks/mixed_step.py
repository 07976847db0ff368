"""A mixed step (``engine.mixed_step``: a prompt chunk and the running rows' decode in one forward) against
the two forwards the server runs without it, side by side in one process.

    OMP_NUM_THREADS=1 python benchmarks/mixed_step.py --rows 8 --chunk 380 --out FILE

Per round, alternating: the chunk on its own prompt cache and then the rows' decode step (eager, and
compiled where ``--compile``), against ``mixed_forward`` doing both. The batch cache is the server's
(static shapes, the default budget); each row holds ``--context`` tokens first. Reports the median
ms of each form and the ratios, as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from h2ochat.config import CacheSettings
from h2ochat.engine.compiled import CompiledDecode
from h2ochat.engine.forward_step import forward
from h2ochat.engine.generation import prefill
from h2ochat.engine.mixed_step import mixed_forward
from h2ochat.loading.models import load
from h2ochat.model_shape import attention_shape
from json_report import emit


def new_cache(model, settings: CacheSettings, rows: int, static_shapes: bool = True):
    """The server's batch cache (static shapes) or prompt cache (the REPL's kind)."""
    cache = settings.build(model, static_shapes=static_shapes)
    heads, head_dim = attention_shape(model.config)
    cache.allocate(rows, heads, head_dim, dtype=next(model.parameters()).dtype, device="cpu")
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=380)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--compile", action="store_true", help="time the compiled decode step too")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load(args.model, dtype=args.dtype, decode_rows=args.rows)
    model = loaded.model
    settings = CacheSettings(budget=args.budget)
    batch = new_cache(model, settings, args.rows)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prefill(model, batch, torch.randint(10, vocab, (args.rows, args.context), generator=generator))
    compiled = CompiledDecode(model, graphs=1) if args.compile else None
    times: dict[str, list[float]] = {"separate eager": [], "mixed": []}
    if compiled is not None:
        times["separate compiled"] = []
    tokens = torch.randint(10, vocab, (args.rows,), generator=generator)
    chunk = torch.randint(10, vocab, (1, args.chunk), generator=generator)
    with torch.inference_mode():
        if compiled is not None:
            compiled(batch, tokens.view(-1, 1))  # (compiles)
        for round_ in range(args.rounds + 1):
            for form in times:
                prompt = new_cache(model, settings, 1, static_shapes=False)
                started = time.perf_counter()
                if form == "mixed":
                    mixed_forward(model, prompt, chunk, batch, tokens)
                else:
                    forward(model, prompt, chunk, logits_to_keep=1)
                    if form == "separate compiled":
                        compiled(batch, tokens.view(-1, 1))
                    else:
                        forward(model, batch, tokens.view(-1, 1), logits_to_keep=1)
                if round_:  # (the first round warms up)
                    times[form].append((time.perf_counter() - started) * 1e3)
    medians = {form: statistics.median(values) for form, values in times.items()}
    record = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/mixed_step.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False) and k != "compile")
        + (" --compile" if args.compile else ""),
        "model": args.model, "dtype": str(next(model.parameters()).dtype), "rows": args.rows, "chunk": args.chunk,
        "context": args.context, "slots": batch.layers[0].capacity, "rounds": args.rounds,
        "median_ms": medians, "ms": times,
        "mixed_over_separate_eager": medians["mixed"] / medians["separate eager"],
    }
    if compiled is not None:
        record["mixed_over_separate_compiled"] = medians["mixed"] / medians["separate compiled"]
    emit(record, args.out)


if __name__ == "__main__":
    main()
