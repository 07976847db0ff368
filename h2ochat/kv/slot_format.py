"""How a layer's slots hold keys and values (``--kv-dtype``): as floats (the model's dtype, or a cast
to another float type) or as quantized codes with a per-slot scale and offset beside them (int8,
int4; the format is ``h2ochat_kernels.quant``'s).

One format per layer (``FloatSlots`` or ``QuantizedSlots``), made at allocation: it owns the names
of its per-slot tensors (``tensor_names``) and allocates them, encodes new tokens as the slots store
them, attends over them through the kernel ``Backend`` (the codes go with their scales), writes what
an eviction's victim slot gets beside the keys and values (``write_extras``), moves keys to new
positions (a re-numbering), gives the keys and values back as floats (``decoded``: a tier archiving
them) and says what a slot costs in bytes. The layer keeps the format's tensors as state tensors by
these names, so export/import, parked rows, reset, prefixes and the compiled step take them like
the rest, and asks the format instead of its type (no ``if quantized`` outside this module); a
recall tier's columns are the layer's last ones and hold the same format (``recall.tier``).

int4 keys are turned by the fixed spreading rotation (``recall.selectors.spreading_rotation``)
before they are quantized: a key's few outlier channels would otherwise set its range and flatten
every other channel to a level or two. The queries are turned the same way in the step (q R . k R
= q . k), the new tokens' keys too (one softmax over slots and new tokens); values are not turned.
"""

from __future__ import annotations

import inspect

import torch
from h2ochat_kernels.rotation import spreading_rotation
from h2ochat_kernels.quant import SCALE_TENSORS  # (None in float slots)

from ..rotary import rotate_keys

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "int8", "int4")
# fp8: a plain cast to float8_e4m3fn (no scales): its range (+-448) holds the keys and values of the
# models served, and its 3 mantissa bits are what one byte of a float keeps
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp8": torch.float8_e4m3fn}
QUANT_BITS = {"int8": 8, "int4": 4}


def check_kv_dtype(name: str) -> str:
    """``name`` as given, when it is one of ``KV_DTYPES``; ValueError in one line otherwise."""
    if str(name).strip().lower() not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    return str(name).strip().lower()


def slot_format(kv_dtype: str, head_dim: int, value_dim: int, model_dtype: torch.dtype) -> "FloatSlots | QuantizedSlots":
    """The format of one layer's slots for ``--kv-dtype`` ``kv_dtype`` and a model computing in ``model_dtype``."""
    name = check_kv_dtype(kv_dtype)
    if name in QUANT_BITS:
        return QuantizedSlots(QUANT_BITS[name], head_dim, value_dim, model_dtype)
    return FloatSlots(FLOAT_DTYPES.get(name, model_dtype), head_dim, value_dim)


def bytes_per_slot(kv_dtype: str, head_dim: int, value_dim: int, model_dtype: torch.dtype) -> int:
    """Device bytes of one slot of one KV head: key and value, codes and scales counted."""
    return slot_format(kv_dtype, head_dim, value_dim, model_dtype).slot_bytes


class FloatSlots:
    """Keys and values as floats of ``dtype`` (the model's own: today's cache; or a cast)."""

    quantized = False
    tensor_names = ("keys", "values")
    fused_writes = True  # the backend's eviction kernels write float keys and values themselves

    def __init__(self, dtype: torch.dtype, head_dim: int, value_dim: int):
        self.dtype, self.head_dim, self.value_dim = dtype, head_dim, value_dim
        self.slot_bytes = (head_dim + value_dim) * torch.finfo(dtype).bits // 8

    def allocate(self, shape: tuple[int, int, int], device) -> dict[str, torch.Tensor]:
        return {"keys": torch.zeros(*shape, self.head_dim, dtype=self.dtype, device=device),
                "values": torch.zeros(*shape, self.value_dim, dtype=self.dtype, device=device)}

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """New tokens [B, Hkv, Q, D] as the slots hold them: cast to the slots' dtype (a no-op for the
        model's own, and no op then: a CPU decode step pays per op; fp8 must be cast before it meets the slots,
        torch promotes nothing to float8)."""
        return {name: t if t.dtype == self.dtype else t.to(self.dtype) for name, t in (("keys", key), ("values", value))}

    def attend(self, backend, query, slots: dict, token_index, key, value, new_valid, scale, scores, decay, rest=None):
        return backend.attend_with_scores(query, slots["keys"], slots["values"], token_index, key, value, new_valid,
                                          scale, scores, decay, rest=rest)

    def move_keys(self, slots: dict, delta: torch.Tensor, rotary) -> None:
        """RoPE keys turned by ``delta`` [B, Hkv, S] positions, in place."""
        rotate_keys(slots["keys"], delta, rotary)

    def keys_and_values(self, slots: dict, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' keys and values as floats [B, Hkv, S, D] (a tier archiving them, a test)."""
        return slots["keys"].to(dtype), slots["values"].to(dtype)

    def decoded(self, slots: dict, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as a tier archives them: float slots as they are held."""
        return slots["keys"], slots["values"]

    def held_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Float keys as the slots give them back (a recall digest scores them): as they are."""
        return keys

    def write_extras(self, slot, slots: dict, stored: dict, active, coordinates) -> None:
        """Nothing beside the keys and values (``QuantizedSlots.write_extras``)."""


class QuantizedSlots:
    """Keys and values as ``bits``-bit codes (uint8 [..., W]) with a float32 scale and offset per slot;
    int4 keys in the spreading rotation's frame."""

    quantized = True
    tensor_names = ("keys", "values", *SCALE_TENSORS)
    fused_writes = False  # codes and their scales: ``reference.write_slots`` and ``write_extras``

    def __init__(self, bits: int, head_dim: int, value_dim: int, model_dtype: torch.dtype):
        from h2ochat_kernels import quant

        self.quant, self.bits, self.head_dim, self.value_dim = quant, bits, head_dim, value_dim
        self.dtype = torch.uint8
        self.model_dtype = model_dtype
        self.rotates = bits == 4
        self.slot_bytes = quant.bytes_per_token(head_dim, bits) + quant.bytes_per_token(value_dim, bits)
        self.rotation = None  # int4: the spreading rotation on the slots' device (``allocate``)
        # whether the kernels dequantize inside the attention (else the codes are dequantized here first)
        from h2ochat_kernels import Backend

        self.kernel_takes_quant = "quant" in inspect.signature(Backend.attend_with_scores).parameters

    def allocate(self, shape: tuple[int, int, int], device) -> dict[str, torch.Tensor]:
        width = self.quant.code_width
        slots = {"keys": torch.zeros(*shape, width(self.head_dim, self.bits), dtype=torch.uint8, device=device),
                 "values": torch.zeros(*shape, width(self.value_dim, self.bits), dtype=torch.uint8, device=device)}
        slots.update({name: torch.zeros(shape, dtype=torch.float32, device=device) for name in SCALE_TENSORS})
        if self.rotates:  # made here, once: a compiled step reads it as a constant
            self.rotation = spreading_rotation(self.head_dim, device)
        return slots

    def turn(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or queries [..., D] into the frame the slots' keys are quantized in (int4: rotated)."""
        if not self.rotates:
            return x
        return (x.float() @ self.rotation).to(x.dtype)

    def _unturn(self, keys: torch.Tensor) -> torch.Tensor:
        if not self.rotates:
            return keys
        return keys @ self.rotation.T  # orthogonal: its inverse

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """New tokens [B, Hkv, Q, D] as codes and scales (keys turned first for int4)."""
        key = self.turn(key.float())
        if self.head_dim == self.value_dim:  # keys and values quantized in one call (half the ops of a step)
            codes, scale, offset = self.quant.quantize(torch.stack([key, value.float()], dim=-2), self.bits)
            key_codes, value_codes = codes.unbind(-2)
            key_scale, value_scale = scale.unbind(-1)
            key_offset, value_offset = offset.unbind(-1)
        else:
            key_codes, key_scale, key_offset = self.quant.quantize(key, self.bits)
            value_codes, value_scale, value_offset = self.quant.quantize(value, self.bits)
        return {"keys": key_codes, "values": value_codes, "key_scale": key_scale, "key_offset": key_offset,
                "value_scale": value_scale, "value_offset": value_offset}

    def quant_slots(self, slots: dict):
        return self.quant.QuantSlots(self.bits, slots["key_scale"], slots["key_offset"], slots["value_scale"],
                                     slots["value_offset"], self.head_dim, self.value_dim)

    def attend(self, backend, query, slots: dict, token_index, key, value, new_valid, scale, scores, decay, rest=None):
        """The attention over the codes (the backend dequantizes inside the step) and the new tokens
        at full precision; for int4 the queries and new keys turned as the slots' keys were (a ``rest``
        column's logits are dot products: the turn changes none)."""
        query, key = self.turn(query), self.turn(key)
        quant = self.quant_slots(slots)
        if self.kernel_takes_quant:
            return backend.attend_with_scores(query, slots["keys"], slots["values"], token_index, key, value,
                                              new_valid, scale, scores, decay, quant=quant, rest=rest)
        keys, values = self.quant.dequantized_slots(slots["keys"], slots["values"], quant)
        return backend.attend_with_scores(query, keys, values, token_index, key, value, new_valid, scale, scores, decay,
                                          rest=rest)

    def keys_and_values(self, slots: dict, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' keys (back in the model's frame) and values as floats [B, Hkv, S, D]."""
        keys, values = self.quant.dequantized_slots(slots["keys"], slots["values"], self.quant_slots(slots))
        return self._unturn(keys).to(dtype), values.to(dtype)

    def decoded(self, slots: dict, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as a tier archives them: dequantized into ``dtype``, int4 keys un-turned."""
        return self.keys_and_values(slots, dtype)

    def held_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Float keys [..., D] as the slots would give them back (encoded, then decoded): the recall
        digest scores cold keys moved to new positions as a recalled page will attend them."""
        codes, key_scale, key_offset = self.quant.quantize(self.turn(keys.float()), self.bits)
        return self._unturn(self.quant.dequantize(codes, key_scale, key_offset, self.bits, self.head_dim)).to(keys.dtype)

    def move_keys(self, slots: dict, delta: torch.Tensor, rotary) -> None:
        """Re-numbered RoPE keys: dequantized, back in the model's frame, turned by ``delta`` [B, Hkv, S]
        positions, turned again and quantized anew, in place; a slot that does not move keeps its codes."""
        quant = self.quant_slots(slots)
        keys = self._unturn(self.quant.dequantize(slots["keys"], quant.key_scale, quant.key_offset, self.bits,
                                                  self.head_dim))
        rotate_keys(keys, delta, rotary)
        codes, key_scale, key_offset = self.quant.quantize(self.turn(keys), self.bits)
        moved = delta != 0
        for name, new in (("keys", codes), ("key_scale", key_scale), ("key_offset", key_offset)):
            where = moved.unsqueeze(-1) if new.dim() == moved.dim() + 1 else moved
            slots[name].copy_(torch.where(where, new, slots[name]))

    def write_extras(self, slot: torch.Tensor, slots: dict, stored: dict, active, coordinates) -> None:
        """The new token's scales and offsets into slot ``slot`` [B, Hkv] of each (sequence, KV head),
        where ``reference.write_slots`` puts its codes (a row not ``active`` writes its own back)."""
        where = (*coordinates, slot)
        for name in SCALE_TENSORS:
            buffer, new = slots[name], stored[name][:, :, 0]
            if active is not None:
                new = torch.where(active.view(-1, 1), new, buffer[where])
            buffer.index_put_(where, new)
