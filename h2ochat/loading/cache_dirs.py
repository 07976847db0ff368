"""Where h2ochat keeps what it can make again but would rather not: the de-quantized GGUF copies and
torch.compile's compiled graphs.

The root is ``$H2OCHAT_CACHE_DIR``, else ``$XDG_CACHE_HOME/h2ochat``, else ``~/.cache/h2ochat``.
Inductor keeps its compiled graphs under the system's temporary folder by default
(``/tmp/torchinductor_<user>``), which many systems empty at each boot or per service: a server
started again there compiles again, minutes on a CPU. Under the root they last, and inductor's
cache is keyed by the graph, the torch version and its settings itself (a second model, or other
settings, get graphs of their own beside the first's).

What a second start reuses from that folder: inductor's FX graph cache (the generated code, built) and the
AOTAutograd cache (the traced forward), both on by default, so neither the lowering nor the C++ compile runs
again. Dynamo still traces the step in every process: its precompile cache (``TORCH_CACHING_PRECOMPILE``)
would keep the trace too, but refuses transformers' LLaMA, which defines a class in local scope. The
figures: ``benchmarks/results_single_stream.json``.
"""

from __future__ import annotations

import os
from pathlib import Path

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_root() -> Path:
    root = os.environ.get("H2OCHAT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "h2ochat"
    return Path(root)


def persistent_compile_cache() -> Path:
    """Point inductor's cache at ``<root>/inductor`` unless a folder is chosen (TORCHINDUCTOR_CACHE_DIR);
    the folder in use. The command line calls it first thing: importing ``torch._dynamo`` fixes the
    folder (it sets the variable to its default when unset)."""
    chosen = os.environ.get(INDUCTOR_ENV)
    if chosen:
        return Path(chosen)
    folder = cache_root() / "inductor"
    os.environ[INDUCTOR_ENV] = str(folder)
    return folder
