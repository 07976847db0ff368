"""h2ochat: chat and long-form generation in a fixed KV-cache budget (the H2O heavy-hitter cache).

Layers, lowest first; a module imports only from its own layer and the ones below it
(``tests/test_layout.py`` holds the order): the kernels (``h2ochat_kernels``); the foundations kept at
the top because every layer above reads them (``sizes``: amounts and byte sizes as the user writes
them; ``threads``: the CPU threads torch computes with; ``console``: the Rich consoles; ``policies``:
the eviction policies the cache and the options share; ``model_shape``: what a model's configuration
says about its attention, read before anything loads; ``budget``: reading ``--budget``; ``rotary``:
rotating RoPE keys, which both tiers re-number with); ``kv`` (the cache); ``recall`` (the tier of
evicted tokens); the two modules where they meet, ``cache_factory`` (a cache with the tier its
settings name) and ``config`` (the settings a run is made with, which build it); ``engine`` (running a
model through its cache); ``loading`` (a name to a loaded model); ``errors`` (a failure the user can
fix as one line: it knows loading's ``ModelError``); ``chat``; ``measure`` and ``serve``, side by
side; ``options`` (the command-line options, from the settings); ``commands``; ``cli``.
"""
