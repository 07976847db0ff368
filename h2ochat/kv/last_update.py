"""The cache whose ``update`` last parked keys, per thread: how the h2o attention finds its cache when
transformers' own ``generate()`` calls it without one (``engine.attention``)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layer import H2OLayer


class LastUpdate(threading.local):
    """The cache whose ``update`` last parked keys in one of its layers, on this thread: how the
    attention function finds its cache under transformers' own generate(), which passes it no
    ``h2o_cache`` (every family calls ``update`` just before its attention)."""

    cache = None
    layer: "H2OLayer | None" = None

    def record(self, cache, layer: "H2OLayer") -> None:
        self.cache, self.layer = cache, layer

    def take(self):
        """The cache recorded, once: None when nothing was, or when its keys were attended already."""
        cache, layer = self.cache, self.layer
        self.cache = self.layer = None
        return cache if layer is not None and layer.pending_key is not None else None

    def release(self, cache) -> None:
        """Forget ``cache`` once its keys were attended (the record would keep a cache dropped by its
        owner alive until another cache updated on this thread)."""
        if self.cache is cache:
            self.cache = self.layer = None


last_update = LastUpdate()
