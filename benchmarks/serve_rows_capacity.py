"""Rows a server holds in one --kv-memory with recall and without, and the host memory recall's cold stores take.

1. Rows: the loader's choice (``serve.server.choose_rows``, no load served) for ``--model`` (SmolLM2-135M by
   default) at ``--kv-memory`` (1 GiB), with recall (the serve default) and without (``--recall 0``); beside it,
   what the earlier sizing gave, which counted each row's cold store for the model's full window
   (``cold_row_bytes``) against the same memory on a CPU, and the --recall-memory default on this machine.
2. Host memory: the model's cold stores (its layers, KV heads and dtype; the default cold format; pages of 8) for
   that many rows, each row evicting N tokens through the stores' own appends, and the bytes in memory
   (``mincore`` over the stores' pages: ``host_buffers.resident_bytes``) and as the bound counts them
   (``written_nbytes``), against the full-window reservation the earlier sizing counted. A ring (``--cold-limit``
   of the window) is measured too: its frames were filled whole when made.

    python benchmarks/serve_rows_capacity.py --out benchmarks/results_serve_rows_capacity.json
"""

from __future__ import annotations

import argparse

import torch

from json_report import emit

from h2ochat.chat.split import format_bytes
from h2ochat.config import CacheSettings
from h2ochat.engine.generation import max_positions
from h2ochat.host_buffers import resident_bytes
from h2ochat.loading.models import load
from h2ochat.loading.sources import DEFAULT_MODEL
from h2ochat.recall.cold_store import ColdStore
from h2ochat.serve.backend import ModelBackend
from h2ochat.serve.parked import ParkedStore
from h2ochat.serve.server import ServeConfig, choose_recall_memory, choose_rows, cold_row_bytes
from h2ochat.sizes import parse_size

PAGE = 8
EVICTED = (0, 512, 2048)  # and the window's worth: every token past a row's slots (what the earlier sizing counted)


def rows_held(loaded, kv_memory: int, recall: str) -> dict:
    """The loader's row count and figures for ``recall`` (``auto``: serve's default; ``0``: none)."""
    settings = CacheSettings(recall=recall)
    config = ServeConfig(model="x", settings=settings, kv_memory=kv_memory)
    probe = ModelBackend(loaded.model, settings, 1, store=ParkedStore(0), prefill_chunk=512)
    row_bytes = probe.row_bytes()
    positions = max_positions(loaded.model.config)
    cold = cold_row_bytes(probe, positions)
    rows, said = choose_rows(config, row_bytes, loaded.device)
    figures = {"recall": recall, "slots": probe.slots, "row_device_bytes": row_bytes, "rows": rows, "said": said,
               "cold_bytes_per_row_at_window": cold, "window": positions,
               "rows_when_the_window_was_counted": kv_memory // (row_bytes + cold)}
    if cold:
        bound, source = choose_recall_memory(config, rows * row_bytes if loaded.device.type == "cpu" else 0)
        figures.update(recall_memory_default=bound, recall_memory_said=source)
    return figures


def store_memory(loaded, rows: int, limit: int | None, evicted_counts) -> list[dict]:
    """The model's cold stores for ``rows`` rows after each row evicted N tokens (``evicted_counts``)."""
    config = loaded.model.config
    layers = config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(loaded.model.parameters()).dtype
    # one layer's stores measured, the model's layers alike: times ``layers``
    store = ColdStore(rows, heads, dim, dim, PAGE, dtype, limit=limit)
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(rows, heads, PAGE, dim, generator=generator).to(dtype) for _ in range(2))
    results, written = [], 0
    for evicted in evicted_counts:
        while written < evicted:
            index = torch.arange(written, written + PAGE).expand(rows, heads, PAGE).contiguous()
            store.append(keys, values, index, index)
            written += PAGE
        results.append({"evicted_per_row": evicted, "cold_limit": limit,
                        "resident_bytes": layers * sum(resident_bytes(tensor) for tensor in store.state_tensors().values()),
                        "written_bytes": layers * store.written_nbytes(), "allocated_bytes": layers * store.nbytes()})
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kv_memory = parse_size(args.kv_memory)
    loaded = load(args.model, "cpu", "auto")
    with_recall, without = rows_held(loaded, kv_memory, "auto"), rows_held(loaded, kv_memory, "0")
    rows = with_recall["rows"]
    reserved = rows * with_recall["cold_bytes_per_row_at_window"]
    window = with_recall["window"]
    counts = (*EVICTED, (window - with_recall["slots"]) // PAGE * PAGE)
    stores = store_memory(loaded, rows, None, counts) + store_memory(loaded, rows, window, counts)
    for entry in stores:
        entry["resident_over_window_reservation"] = round(entry["resident_bytes"] / reserved, 4)
    report = {"model": args.model, "kv_memory": kv_memory, "device": str(loaded.device),
              "dtype": str(next(loaded.model.parameters()).dtype), "with_recall": with_recall, "without_recall": without,
              "window_reservation_bytes": reserved, "cold_stores": stores}
    emit(report, args.out, what=f"rows held by serve --kv-memory {args.kv_memory} with and without recall, and the "
                                "cold stores' host memory after N evicted tokens per row")
    print(f"rows: {with_recall['rows']} with recall, {without['rows']} without (the window counted: "
          f"{with_recall['rows_when_the_window_was_counted']}); full-window reservation {format_bytes(reserved)}")
    return report


if __name__ == "__main__":
    main()
