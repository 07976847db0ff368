"""Loading a model: a name to a source (``sources``: aliases, shipped configurations, hub ids, local
directories, GGUF files), the hub's metadata and download (``hub``), the de-quantized copy of a GGUF
file kept for next time (``gguf_conversion``), the memory check before any weight loads (``memory``),
a model of random weights from a shipped configuration (``random_weights``), whether the CPU
multiplies bf16 natively (``native_bf16``: what ``--dtype auto`` picks), and ``models.load``,
which puts them together and hands back a model that runs the ``h2o`` attention. It stands above the
engine only for that registration (``engine.attention``); nothing below imports it."""
