"""The one way to make a cache: ``make_cache`` turns a device budget (slots per layer, sequence and
KV head) and the tier's settings into an ``H2OCache`` (``make_mixed_cache``: rows of different
policies, for ``eval``). Every command builds through it (generation's ``CacheSettings.build``, which
the chat, story, generate, the server and the pass-key task use; ``eval``'s rows; ``bench``'s
variants), so the split of the device slots between the policy and a tier is written once, here."""

from __future__ import annotations

from .kv.cache import H2OCache


def policy_slots(device_slots: int, recall=None) -> int:
    """The policy's share of ``device_slots``: all of them, less the recall tier's R."""
    return device_slots - (recall.slots if recall is not None else 0)


def make_cache(num_layers: int, policy, device_slots: int, *, recall=None, **kwargs) -> H2OCache:
    """A cache of ``device_slots`` slot columns per layer (the policy may shape them by depth):
    ``recall`` (a ``recall.tiered.RecallConfig``, or None) takes R of them for recalled pages and
    keeps what the policy evicts in a cold tier. ``kwargs`` go to ``H2OCache`` (max_positions,
    positions, rotary, seed, static_shapes, rows)."""
    if recall is None:
        return H2OCache(num_layers, policy, device_slots, **kwargs)
    from .recall.spec import RecallSpec  # (recall builds on kv: the tier is named only when asked for)

    return H2OCache(num_layers, policy, policy_slots(device_slots, recall), tier=RecallSpec(recall), **kwargs)


def make_mixed_cache(num_layers: int, rows, **kwargs) -> H2OCache:
    """A cache whose batch row i follows ``rows[i]`` (a ``kv.rows.RowSpec``: its policy, budget and
    seed; ``eval`` runs a whole table as one batch this way): each layer allocates the widest row's
    slots, and a ``full`` row gets its slots up front (give it as many as the text has tokens)."""
    return make_cache(num_layers, rows[0].policy, max(r.slots for r in rows), rows=rows, **kwargs)
