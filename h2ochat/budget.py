"""Reading --budget: a fraction of the context window, a number of slots, or a size in bytes."""

from __future__ import annotations

from .sizes import is_size, parse_fraction, parse_size

BUDGET_FORMS = "a share like 0.2, a count like 512 or a size like 16MiB"


def parse_budget(text: str | float | int, max_positions: int) -> int:
    """Slots per (layer, sequence, KV head) for a --budget value given as a share or a count.

    A value written with a decimal point or exponent ("0.2", "1.0", "1e-1") is a fraction in
    (0, 1] of the model's context window; a plain integer ("512", "1") is a number of slots.
    So "1.0" is the whole window and "1" is a single slot. A size ("16MiB") is ``budget_bytes``'s:
    its slots depend on the model and --kv-dtype (``slots_in_bytes``).
    """
    if is_size(text):
        raise ValueError(f"--budget {str(text).strip()} is a size: its slots depend on the model (slots_in_bytes)")
    return parse_fraction(text, "--budget", max_positions, BUDGET_FORMS)


def budget_bytes(text: str | float | int) -> int | None:
    """The bytes of a --budget written as a size ("16MiB", "512KiB", "1.5GiB"), None for a share or a
    count; ValueError in one line for a size of 0."""
    return parse_size(str(text).strip(), "--budget") if is_size(text) else None


def slots_in_bytes(size: int, slot_bytes: int, layer_slots, num_layers: int, *, typed: str = "",
                   kv_dtype: str = "auto") -> int:
    """The most slots per layer whose device KV bytes fit in ``size``: ``slot_bytes`` is one slot of
    one layer over its KV heads (keys, values, their scales), ``layer_slots(slots, num_layers)`` the
    policy's slots per layer for a budget (a shape by depth may round). ValueError in one line when
    not even one slot per layer fits."""
    slots = size // (slot_bytes * num_layers)
    while slots > 0 and sum(layer_slots(slots, num_layers)) * slot_bytes > size:
        slots -= 1
    if slots < 1:
        raise ValueError(f"--budget {typed or size} holds no slot: one slot in each of the {num_layers} layers "
                         f"takes {slot_bytes * num_layers} bytes with --kv-dtype {kv_dtype}")
    return slots
