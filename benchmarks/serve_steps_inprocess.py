"""A server's scheduler steps timed in-process (no HTTP): waves of prompts on a ``ModelBackend`` of the
server's default settings, mixed prefill/decode steps on or off (issue 35, session 53).

    OMP_NUM_THREADS=1 python benchmarks/serve_steps_inprocess.py mixed
    OMP_NUM_THREADS=1 python benchmarks/serve_steps_inprocess.py apart

Prints the steps that read a prompt chunk and those that only decode: how many, median ms, total s.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serve_fakes import make_request  # noqa: E402

from h2ochat.config import CacheSettings  # noqa: E402
from h2ochat.loading.models import load  # noqa: E402
from h2ochat.serve.backend import ModelBackend  # noqa: E402
from h2ochat.serve.parked import ParkedStore  # noqa: E402
from h2ochat.serve.scheduler import Scheduler  # noqa: E402

ROWS, WAVES, PER_WAVE, PROMPT, REPLY = 26, 3, 8, 300, 64


def main() -> None:
    mixed = sys.argv[1:] == ["mixed"]
    torch.set_num_threads(1)
    loaded = load("smollm2-135m", decode_rows=ROWS)
    backend = ModelBackend(loaded.model, CacheSettings(), ROWS, store=ParkedStore(1 << 30), prefill_chunk=512,
                           compile=None, mixed_steps=mixed)
    print("compiled", backend.compiled, "mixes", backend.mixes_steps, flush=True)
    backend.compiled_warm_up()
    scheduler = Scheduler(backend)
    rng = random.Random(0)
    times: dict[str, list[float]] = {"reads a chunk": [], "decodes only": []}
    for _ in range(WAVES):
        for _ in range(PER_WAVE):
            scheduler.submit(make_request([rng.randrange(10, 40000) for _ in range(PROMPT)], max_tokens=REPLY,
                                          stop_ids=()))
        while not scheduler.idle:
            kind = "reads a chunk" if (scheduler.job is not None or scheduler.waiting) else "decodes only"
            started = time.perf_counter()
            scheduler.step()
            times[kind].append(time.perf_counter() - started)
    for kind, values in times.items():
        print(f"{kind}: {len(values)} steps, median {statistics.median(values) * 1e3:.1f} ms, total {sum(values):.1f} s")


if __name__ == "__main__":
    main()
