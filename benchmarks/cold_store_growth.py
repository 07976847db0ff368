"""CPU time of the cold stores' growth with and without the room their mappings reserve (session 57, issue 34):
a served batch's stores, growing a page of each row a flush, as a server's do.

SmolLM2-135M's 30 layers of cold stores (3 KV heads of 64, pages of 8, the default cold format), ``--rows``
rows, each flush one page of 8 tokens per row appended through the store's C route (room reserved first,
as ``RecallTier.flush`` does), until every row holds ``--tokens``. Each run builds the stores afresh; the
two settings alternate (``--repeats`` pairs) so a change of the machine's load falls on both. ``ROOM 1``
reserves no room: every growth copies the store, as before. Reported: the CPU seconds of the whole fill and
of its ``reserve`` calls (the growth), the bytes the stores report (``nbytes``: the slots, not the room)
and the bytes in memory (``mincore`` over the stores' pages), with the medians' ratios.

    python benchmarks/cold_store_growth.py --rows 8 --tokens 2000 --out benchmarks/results_cold_store_growth.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from h2ochat.host_buffers import resident_bytes
from h2ochat.recall import layout
from h2ochat.recall.cold_store import ColdStore
from json_report import write

LAYERS, HEADS, DIM, PAGE = 30, 3, 64, 8


def fill(room: int, rows: int, tokens: int) -> dict:
    """The stores filled a page a flush with ``layout.ROOM = room``: CPU seconds and bytes."""
    layout.ROOM = room
    generator = torch.Generator().manual_seed(0)
    stores = [ColdStore(rows, HEADS, DIM, DIM, PAGE, torch.bfloat16, cold_dtype="auto") for _ in range(LAYERS)]
    keys, values = (torch.randn(rows, HEADS, PAGE, DIM, generator=generator).bfloat16() for _ in range(2))
    growth = 0.0
    start = time.process_time()
    for flush in range(tokens // PAGE):
        index = torch.arange(flush * PAGE, (flush + 1) * PAGE).expand(rows, HEADS, PAGE).contiguous()
        for store in stores:
            before = time.process_time()
            store.reserve(int(store.count.max()) + PAGE)
            growth += time.process_time() - before
            store.append(keys, values, index, index, reserve=False)
    total = time.process_time() - start
    names = stores[0]._buffers()
    return {"room": room, "cpu_s": round(total, 3), "growth_cpu_s": round(growth, 3),
            "reported_bytes": sum(store.nbytes() for store in stores),
            "resident_bytes": sum(resident_bytes(getattr(store, name)) for store in stores for name in names)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens each row's stores end with")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (without room, with room)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kept = layout.ROOM
    runs = [fill(room, args.rows, args.tokens) for _ in range(args.repeats) for room in (1, kept)]
    layout.ROOM = kept

    def median(room, key):
        return statistics.median(run[key] for run in runs if run["room"] == room)

    report = {"issue": 34, "rows": args.rows, "tokens": args.tokens, "layers": LAYERS, "page": PAGE, "runs": runs,
              "copying_over_room": {key: round(median(1, key) / median(kept, key), 3)
                                    for key in ("cpu_s", "growth_cpu_s", "reported_bytes", "resident_bytes")}}
    write(report, args.out)
    print(json.dumps(report["copying_over_room"]))
    return report


if __name__ == "__main__":
    main()
