"""Host memory of a batch's recall stores when one row is long and the others short (issue 34: cold stores
sized by each row's own length): RSS growth against the bytes the rows hold and the bytes allocated.

A server's batch keeps one cold store and one digest per layer for all its rows, with the longest row's
capacity. This builds SmolLM2-135M's 30 layers of them (3 KV heads of 64, pages of 8, the default cold
format and the rot4 selector's 4-bit codes), appends each row's evicted tokens in 512-token chunks (the
stores grow as a served batch's do), and reports the bytes of the stores' pages in memory (``mincore``: the
pages written, through ``host_buffers.resident_bytes``; nothing is read here, since a read of an unwritten page
maps the system's zero page, which ``mincore`` counts and RSS does not), the bytes the rows' tokens take, and
the bytes allocated (``nbytes``).

    python benchmarks/recall_row_memory.py --rows 16 --long 4000 --short 300 --out FILE
"""

from __future__ import annotations

import argparse
import sys

import torch

from h2ochat.host_buffers import resident_bytes
from h2ochat.recall.cold_store import ColdStore
from h2ochat.recall.digests import KeyCodes
from h2ochat.recall.synthetic import append_rows
from json_report import emit

LAYERS, HEADS, DIM, PAGE = 30, 3, 64, 8


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--long", type=int, default=4000, help="evicted tokens of the one long row")
    parser.add_argument("--short", type=int, default=300, help="evicted tokens of each other row")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    rows_tokens = [args.long] + [args.short] * (args.rows - 1)
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        store = ColdStore(args.rows, HEADS, DIM, DIM, PAGE, torch.bfloat16, cold_dtype="int8-values")
        codes = KeyCodes(args.rows, HEADS, DIM, PAGE, 4, rotate=True)
        append_rows(store, rows_tokens, generator, codes)
        layers.append((store, codes))
    in_memory = sum(resident_bytes(tensor) for store, codes in layers
                    for tensor in (*(getattr(store, n) for n in store._buffers()), *(getattr(codes, n) for n in codes._per_slot())))
    def slot_bytes(part, names):  # bytes one token of one (row, head) takes in ``part``'s per-slot tensors
        return sum(getattr(part, name)[0, 0, 0].numel() * getattr(part, name).element_size() for name in names)
    per_token = slot_bytes(store, store._buffers()) + slot_bytes(codes, codes._per_slot())
    held = sum(rows_tokens) * HEADS * per_token * LAYERS
    allocated = sum(store.nbytes() + codes.nbytes() for store, codes in layers)  # (the digest: host memory on a CPU)
    result = {"rows": args.rows, "long": args.long, "short": args.short, "layers": LAYERS,
              "resident_bytes": in_memory, "held_bytes": held, "allocated_bytes": allocated,
              "resident_over_held": round(in_memory / held, 3), "allocated_over_held": round(allocated / held, 3),
              "argv": sys.argv}
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
