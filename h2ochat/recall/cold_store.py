"""The cold tier: evicted tokens' keys, values, token indices and positions in host memory.

One store per layer, per (sequence, KV head) an append-only sequence of pages of P tokens in eviction
order (``layout``). Host memory (pinned when the cache lives on a GPU, so copies to the device can
be asynchronous). ``cold_dtype``: ``"model"`` keeps keys and values at the model's dtype; ``"int8-values"``
keeps the keys so and the values as int8 codes with one fp32 scale per token and head (symmetric,
max |x| / 127); ``"bf16-keys"`` keeps the values so and the keys in bf16 (``key_dtype``: an fp32 model's keys
at half the bytes, widened exactly when a page comes back; the exact selector scores them with the queries
rounded to bf16, as a bf16 model's are); ``"int8"`` keeps both as int8 codes; ``"auto"`` is int8 values with
16-bit keys (``resolved_cold_dtype``). ``limit`` (tokens per sequence and head, rounded up to whole
pages) makes the store a ring: the oldest pages are overwritten and counted in ``dropped``.

Each token also keeps the position it was encoded at (``encoded``: what its key's rotation says)
and its position in the cache's current numbering (``positions``); the two differ after a compact
re-numbering (``renumber``), and a key is rotated by their difference when it is brought back.
Token indices and positions are stored as int32 (``BOOKKEEPING``: 12 bytes a token and head, not
24: the host store's bound) and handed out as int64, as the cache's own are.

On a GPU whose driver maps pinned memory into the device's address space (``zero_copy``, as
``h2ochat_kernels.dispatch.zero_copy_rows`` decides), appends and page gathers are Triton kernels that write and
read the host buffers directly on the step's stream (``dispatch.row_kernels``), and ``count`` lives on the GPU: the
step never waits for the host. Host-side work on the buffers (growing, re-numbering, a rebuild's
read) first waits for those kernels (``_settle``). Elsewhere the buffers are read and written by
ordinary torch ops (a GPU without zero-copy pays a synchronising copy per layer and step).

Every buffer has one column past its slots, the spill slot. A step's appends write back what the target
holds for the rows and heads that evicted nothing (``layout.Writes``: their next free slot, or in a ring the
spill slot), so an append is one indexed write per buffer whatever was evicted. The spill slot is never
read, and its token index stays -1.
"""

from __future__ import annotations

import torch
from h2ochat_kernels import dispatch
from h2ochat_kernels.cpu import recall_ops, store_ops

from ..rotary import Rotary, rotate_keys
from ..host_buffers import store_buffer
from .layout import FirstRows, Writes, growable, held_pages, narrowed, rows_held, tensor_bytes, widened

COLD_DTYPES = ("auto", "model", "int8-values", "bf16-keys", "int8")
BOOKKEEPING = torch.int32  # token indices and positions (2**31 tokens of one conversation: far past any context)
_MINUS_ONE_WHEN_EMPTY = ("token_index", "encoded", "positions")
OLD_COLD_DTYPES = {"same": "model"}  # the earlier name of model, still accepted


def cold_dtype_named(name: str) -> str:
    """``--cold-dtype`` as one of COLD_DTYPES (a ValueError naming them for anything else)."""
    name = OLD_COLD_DTYPES.get(name, name)
    if name not in COLD_DTYPES:
        raise ValueError(f"--cold-dtype must be one of {', '.join(COLD_DTYPES)}, got {name!r}")
    return name


def auto_cold_dtype(dtype: torch.dtype) -> str:
    """What auto stands for with a ``dtype`` model: int8 values and keys of 16 bits, an fp32 model's in bf16
    (the exact selector reads every cold key each step, and on a CPU without native bf16, where ``--dtype
    auto`` is fp32, those keys were twice a bf16 model's bytes to read and to hold)."""
    return "bf16-keys" if dtype == torch.float32 else "int8-values"


def resolved_cold_dtype(name: str, dtype: torch.dtype | None = None) -> str:
    """``--cold-dtype`` as the format a store of a ``dtype`` model takes (auto: ``auto_cold_dtype``; with no
    dtype, auto stays auto)."""
    name = cold_dtype_named(name)
    return auto_cold_dtype(dtype) if name == "auto" and dtype is not None else name


def key_dtype_of(cold_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a store of format ``cold_dtype`` (resolved) keeps a ``dtype`` model's keys in."""
    return {"int8": torch.int8, "bf16-keys": torch.bfloat16}.get(cold_dtype, dtype)


def _to_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127
    return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale.squeeze(-1)


KEEP_SHARE = (3, 4)  # ``fit`` keeps a store whose rows need more than this share of its slots (3/4)


class ColdStore(FirstRows):
    def __init__(self, batch: int, heads: int, head_dim: int, value_dim: int, page: int, dtype: torch.dtype,
                 *, cold_dtype: str = "auto", limit: int | None = None, pin: bool = False, initial_pages: int = 1,
                 device: torch.device | str | None = None, zero_copy: bool | None = None):
        cold_dtype = resolved_cold_dtype(cold_dtype, dtype)
        if page < 1:
            raise ValueError(f"--page must be at least 1, got {page}")
        if limit is not None and limit < page:
            raise ValueError(f"--cold-limit {limit} holds less than one page of {page} tokens")
        self.heads, self.page, self.dtype = heads, page, dtype
        self.cold_dtype = cold_dtype
        self.quantized_keys = cold_dtype == "int8"
        self.quantized_values = cold_dtype in ("int8", "int8-values", "bf16-keys")
        self.key_dtype = key_dtype_of(cold_dtype, dtype)
        self.frames = -(-limit // page) if limit is not None else None  # ring size in pages
        self.pin = pin
        device = torch.device(device or "cpu")
        if zero_copy is None:
            zero_copy = pin and dispatch.zero_copy_rows(device)
        self.zero_copy, self.device = zero_copy, device
        # tokens ever appended, where the appends are planned (the GPU under zero-copy)
        self.count = torch.zeros(batch, heads, dtype=torch.long, device=device if zero_copy else "cpu")
        slots = (self.frames or initial_pages) * page
        self.keys = self._alloc((batch, heads, slots, head_dim), self.key_dtype, 0)
        self.values = self._alloc((batch, heads, slots, value_dim), torch.int8 if self.quantized_values else dtype, 0)
        self.key_scale = self._alloc((batch, heads, slots), torch.float32, 0) if self.quantized_keys else None
        self.value_scale = self._alloc((batch, heads, slots), torch.float32, 0) if self.quantized_values else None
        self.token_index = self._alloc((batch, heads, slots), BOOKKEEPING, -1)
        self.encoded = self._alloc((batch, heads, slots), BOOKKEEPING, -1)
        self.positions = self._alloc((batch, heads, slots), BOOKKEEPING, -1)
        # some token's current position differs from its encoded one (host flag, set by a re-numbering or
        # an explicit ``encoded``): until then a brought-back key needs no rotation, and pages skip it
        self.moved = False
        self.refused = torch.zeros(batch, heads, dtype=torch.long)  # (host) evicted tokens not kept at ``bound``:
        self.bound = None  # a bound on many stores' memory (``cold_bound``), told of every change of the bytes written

    def _alloc(self, shape, dtype, fill) -> torch.Tensor:
        shape = (*shape[:2], shape[2] + 1, *shape[3:])  # + the spill slot
        if fill == 0:  # (a mapping of its own where large: a ring's frames cost memory only as they are written)
            tensor = store_buffer(shape, dtype, pin=self.pin, zeroed=True)
        else:
            tensor = torch.full(shape, fill, dtype=dtype)
            tensor = tensor.pin_memory() if self.pin else tensor
        return growable(tensor) if self.frames is None else tensor

    @property
    def capacity(self) -> int:
        return self.token_index.shape[2] - 1  # less the spill slot

    def _buffers(self) -> list[str]:
        names = ["keys", "values", "token_index", "encoded", "positions"]
        return names + (["key_scale"] if self.quantized_keys else []) + (["value_scale"] if self.quantized_values else [])

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in [*self._buffers(), "count"]}

    def _settle(self) -> None:
        """Wait for the zero-copy kernels still writing the host buffers (before host code touches them)."""
        if self.zero_copy and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _write(self, writes: Writes, buffer: torch.Tensor, new: torch.Tensor) -> None:
        if self.zero_copy:
            new = writes.kept(new.to(buffer.dtype), self._take(buffer, writes.target))
            dispatch.row_kernels().scatter_rows_(buffer, writes.target, new.contiguous())
        else:
            writes.write(buffer, new)

    def _take(self, buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``buffer`` [B, H, S, ...] at slots ``index`` [B, H, K] (on the count's device)."""
        if self.zero_copy:
            return dispatch.row_kernels().gather_rows(buffer, index)
        return buffer.gather(2, index.unsqueeze(-1).expand(*index.shape, buffer.shape[-1]) if buffer.dim() == 4 else index)

    def rows_held(self) -> list[int]:
        """[B]: the slots each row has written (its longest head's count; a growable store is no ring)."""
        return rows_held(self.count)

    def _grow(self, needed: int) -> None:
        self._settle()
        rows_held = self.rows_held()  # (keys and values are copied row by row: a row's memory follows its length)
        for name in self._buffers():
            old = getattr(self, name)
            setattr(self, name, widened(old, needed, -1 if name in _MINUS_ONE_WHEN_EMPTY else 0, pin=self.pin,
                                        spill=True, page=self.page, rows_held=rows_held, room=True))
        self.note_written()

    # -- writing ----------------------------------------------------------------------------------
    def reserve(self, needed: int) -> None:
        """Room for ``needed`` tokens per (sequence, head), decided on the host before a step (a ring
        never grows): the cache reserves an upper bound, so appending inside the step reads nothing."""
        if self.frames is None and needed > self.capacity:
            self._grow(needed)

    def fit(self, needed: int) -> None:
        """Give back the room past ``needed`` tokens per (sequence, head), in whole pages (at least one),
        when it is more than a quarter of the store: a server whose longest row was reset (a ring keeps
        its frames). The caller knows nothing past ``needed`` is held. (A chat nearly as long as the one
        reset would grow the store back within a few flushes, every row copied twice for nothing: in a
        served load of 8 chats x 4 turns, giving back and growing again were 4% of the recall server's CPU.
        The room kept costs no memory past each row's keys and values: ``host_buffers``.)"""
        size = max(1, -(-needed // self.page)) * self.page
        if self.frames is not None or size * KEEP_SHARE[1] > self.capacity * KEEP_SHARE[0]:
            return
        self._settle()
        rows_held = self.rows_held()
        for name in self._buffers():
            setattr(self, name, narrowed(getattr(self, name), size, rows_held,
                                         -1 if name in _MINUS_ONE_WHEN_EMPTY else 0))
        self.note_written()

    def append(self, keys, values, token_index, positions, encoded=None, *, reserve: bool = True) -> torch.Tensor:
        """Store evicted tokens: keys/values [B, H, E, D], token_index/positions [B, H, E] (token index
        -1: nothing evicted there). Returns their slot numbers [B, H, E] (-1 where nothing).
        ``reserve=False``: the caller reserved room (``reserve``); else growing reads the count back."""
        device = self.count.device
        if not reserve and encoded is None and self.appends_natively():
            slots = store_ops.cold_append({"keys": keys, "values": values, "token_index": token_index,
                                        "positions": positions}, self.named_buffers(), self.count, self.capacity)
            if slots is not None:  # (a CPU's flush of its staging page: one C call)
                self.note_written()
                return slots
        valid = (token_index >= 0).to(device)
        added = valid.sum(dim=-1)
        if reserve:
            self.reserve(int((self.count + added).max()))
        writes = Writes.plan(valid, self.count, self.frames * self.page if self.frames is not None else None,
                             spill=self.capacity)
        keys, values = keys.detach().to(device), values.detach().to(device)
        for quantized, buffer, scale, new in ((self.quantized_keys, self.keys, self.key_scale, keys),
                                              (self.quantized_values, self.values, self.value_scale, values)):
            if quantized:
                codes, scales = _to_int8(new)
                self._write(writes, buffer, codes)
                self._write(writes, scale, scales)
            else:
                self._write(writes, buffer, new)
        self._write(writes, self.token_index, token_index.to(device))
        self._write(writes, self.positions, positions.to(device))
        self._write(writes, self.encoded, (encoded if encoded is not None else positions).to(device))
        if encoded is not None:  # (a compiled step never passes one: no guard on the flag)
            self.moved = True
        self.count += added
        self.note_written()
        return writes.slots

    def appends_natively(self) -> bool:
        """Whether appends with room reserved may go to the C kernels (``native_store``: a store in host memory
        that never wraps, float keys) where they take the tensors."""
        return self.frames is None and not self.quantized_keys and not self.zero_copy

    # -- reading ----------------------------------------------------------------------------------
    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """First and one-past-last page number [B, H] still held."""
        return held_pages(self.count, self.page, self.frames)

    def held_tokens(self) -> torch.Tensor:
        """[B, H]: tokens in the store now (appended minus those its ring overwrote)."""
        return self.count - self._overwritten()

    def _overwritten(self) -> torch.Tensor:
        """[B, H]: tokens lost to --cold-limit (whole pages, oldest first)."""
        first, _ = self.held()
        return (first * self.page).clamp(max=self.count)

    def dropped(self) -> torch.Tensor:
        """[B, H]: evicted tokens not held: lost to --cold-limit, or refused at the stores' bound (``refuse``)."""
        return self._overwritten() + self.refused[: self.count.shape[0]].to(self.count.device)

    def pages(self, page_ids: torch.Tensor, rotary: Rotary | None = None):
        """Bring pages back: ``page_ids`` [B, H, k] absolute page numbers (-1: none, or not held).
        Returns keys, values [B, H, k*P, D] in the store's compute dtype, token_index and positions
        [B, H, k*P] (-1 for empty slots). RoPE keys are rotated from their encoded position to
        their current one."""
        first, end = self.held()
        ok = (page_ids >= first.unsqueeze(-1)) & (page_ids < end.unsqueeze(-1)) & (page_ids >= 0)
        offsets = torch.arange(self.page, device=self.count.device)
        slot = (page_ids.clamp(min=0).unsqueeze(-1) * self.page + offsets)  # [B, H, k, P]
        present = ok.unsqueeze(-1) & (slot < self.count[:, :, None, None])  # (a copy of the first rows too)
        ring = self.frames * self.page if self.frames is not None else None
        index = (slot % ring if ring is not None else slot).masked_fill(~present, 0).flatten(2)
        present = present.flatten(2)
        return self._tokens(lambda buffer: self._take(buffer, index), present, rotary)

    def scored_queries(self, queries: torch.Tensor) -> torch.Tensor:
        """``queries`` as the exact selector scores them against these keys in place: rounded to the keys' dtype
        where it is another float dtype (bf16 keys of an fp32 model: the C kernels take one dtype, and both
        routes score the same products), as they are otherwise."""
        keys = self.key_dtype
        return queries.to(keys) if keys.is_floating_point and keys != queries.dtype else queries

    def page_tokens(self, row: torch.Tensor, head: torch.Tensor, page_ids: torch.Tensor, rotary: Rotary | None = None):
        """``pages`` for N pages named one by one: page ``page_ids[n]`` (absolute) of sequence ``row[n]`` and
        head ``head[n]`` ([N] each, CPU store). Returns keys, values [N, P, D] and token_index, positions
        [N, P], the values ``pages`` gives for them. A CPU step that read its plan loads a few pages of a
        few heads: indexing the buffers by (row, head, slot) takes one op a buffer, where ``pages`` lays
        out [B, H, k] pages and the caller picks them out again."""
        slot = page_ids.unsqueeze(-1) * self.page + torch.arange(self.page, device=page_ids.device)  # [N, P]
        # (a slot below the count is on a page below the held end: ``pages``' end test is implied)
        present = (slot < self.count[row, head].unsqueeze(-1)) & (page_ids >= 0).unsqueeze(-1)
        if self.frames is not None:  # a ring: the oldest pages are gone
            present &= (page_ids >= self.held()[0][row, head]).unsqueeze(-1)
        ring = self.frames * self.page if self.frames is not None else None
        index = (slot % ring if ring is not None else slot).masked_fill(~present, 0)
        rows, heads = row.unsqueeze(-1), head.unsqueeze(-1)
        return self._tokens(lambda buffer: buffer[rows, heads, index], present, rotary)

    def fill_frames(self, slots: dict[str, torch.Tensor], plan, rotary: Rotary | None) -> bool:
        """The pages ``plan`` (a ``step.RecallPlan`` read on the host) loads into its frames of ``slots`` (keys,
        values, token_index, positions [B, H, R, ...]), as ``page_tokens`` gives them, in one C call
        (``recall_ops.fill_frames``); False where it does not run (int8 keys, keys to turn, a GPU's store):
        nothing written, the caller copies them."""
        if self.quantized_keys or (rotary is not None and self.moved) or self.zero_copy:
            return False
        return recall_ops.fill_frames(slots, self.named_buffers(), self.count, self.frames, self.page, plan.load,
                                  plan.frame_page, self.dtype)

    def named_buffers(self) -> dict[str, torch.Tensor | None]:
        """Every buffer by name, value_scale None for float values (what the C kernels take)."""
        return {**{name: getattr(self, name) for name in ("keys", "values", "token_index", "positions", "encoded")},
                "value_scale": self.value_scale}

    def _tokens(self, take, present: torch.Tensor, rotary: Rotary | None):
        """The slots ``take(buffer)`` reads of every buffer, as ``pages`` returns them: keys (rotated to
        their current positions) and values in the compute dtype, token indices and positions as int64,
        and -1 or 0 where not ``present``."""
        absent = ~present
        token_index = take(self.token_index).long().masked_fill(absent, -1)
        positions = take(self.positions).long().masked_fill(absent, -1)
        keys = self._keys_at_current_positions(take(self.keys), take(self.key_scale) if self.quantized_keys else None,
                                               positions, take(self.encoded) if rotary is not None and self.moved else None,
                                               present, rotary)
        values = take(self.values)
        values = (values.float() * take(self.value_scale).unsqueeze(-1) if self.quantized_values else values).to(self.dtype)
        absent = absent.unsqueeze(-1)
        return keys.masked_fill(absent, 0), values.masked_fill(absent, 0), token_index, positions

    def _keys_at_current_positions(self, keys, scale, positions, encoded, present, rotary) -> torch.Tensor:
        """Stored keys (a copy: gathered) in the compute dtype, RoPE keys rotated from the position
        they were encoded at to their current one (``encoded`` None: the same)."""
        keys = (keys.float() * scale.unsqueeze(-1) if scale is not None else keys).to(self.dtype)
        if rotary is not None and encoded is not None:
            rotate_keys(keys, (positions - encoded).masked_fill(~present, 0), rotary)
        return keys

    def keys_by_slot(self, rotary: Rotary | None = None) -> torch.Tensor:
        """Every storage slot's key [B, H, S, D] at its token's current position (the digest is
        rebuilt from these after a re-numbering); empty slots hold whatever they held."""
        self._settle()
        slots = slice(0, self.capacity)
        held = self.token_index[:, :, slots] >= 0
        keys = self.keys[:, :, slots].clone() if not self.quantized_keys else self.keys[:, :, slots]
        scale = self.key_scale[:, :, slots] if self.quantized_keys else None
        return self._keys_at_current_positions(keys, scale, self.positions[:, :, slots], self.encoded[:, :, slots],
                                               held, rotary)

    # -- positions --------------------------------------------------------------------------------
    def forget_renumbering(self) -> None:
        """Every row was overwritten by a row whose tokens were never re-numbered (an import into a
        1-row store: ``RecallRowMoves.import_row``): brought-back keys need no rotation again."""
        self.moved = False

    def renumber(self, renumbering) -> None:
        """The cache re-numbered its held tokens (``cache.Renumbering``, a function of row and old
        position): cold tokens move with the same function, so a cold token not held anywhere takes
        the number of the first held position after it (order kept). ``encoded`` stays: a key is
        rotated by the difference when it is brought back."""
        self._settle()
        self.positions.copy_(renumbering.apply(self.positions, self.token_index >= 0))
        self.moved = True

    def encode_where_they_are(self, keys_by_slot: torch.Tensor, held: torch.Tensor) -> None:
        """The ``held`` [B, H, S] slots' keys replaced by ``keys_by_slot`` [B, H, S, D] (the keys at their
        current positions, ``keys_by_slot``) and marked encoded there: a page brought back is not turned
        again. For a selector that scores these keys in place (``cold_keys``) after a re-numbering."""
        self._settle()
        slots = slice(0, keys_by_slot.shape[2])
        keys, encoded = self.keys[:, :, slots], self.encoded[:, :, slots]
        keys.copy_(torch.where(held.unsqueeze(-1), keys_by_slot.to(keys.dtype), keys))
        encoded.copy_(torch.where(held, self.positions[:, :, slots], encoded))

    # -- accounting -------------------------------------------------------------------------------
    def bounded_by(self, bound) -> None:
        """From now on the store's written bytes count against ``bound`` (``cold_bound.ColdBound``), told of each change."""
        self.bound = bound
        self.note_written()

    def note_written(self) -> None:
        if self.bound is not None:  # (after every change of the bytes written)
            self.bound.note(self)

    def refuse(self, tokens: torch.Tensor) -> None:
        """``tokens`` [B, H] evicted tokens were not kept (the bound on the stores' memory was reached)."""
        self.refused += tokens.to("cpu")
        if self.bound is not None:
            self.bound.refused(int(tokens.sum()))

    def slot_bytes(self) -> tuple[int, int]:
        """One slot's bytes for one (row, head): in the buffers every row writes whole (token indices and positions:
        -1 when empty), and in those a row writes as far as its tokens reach (keys, values, scales)."""
        sizes = {name: getattr(self, name)[0, 0, 0].numel() * getattr(self, name).element_size()
                 for name in self._buffers()}
        whole = sum(size for name, size in sizes.items() if name in _MINUS_ONE_WHEN_EMPTY)
        return whole, sum(sizes.values()) - whole

    def nbytes(self) -> int:
        """Host bytes held (allocated)."""
        return tensor_bytes(getattr(self, name) for name in self._buffers())

    def written_nbytes(self) -> int:
        """Host bytes of the slots the rows have written: each row's keys, values and scales as far as its
        tokens reach, the token indices and positions whole (an empty slot reads -1: written). What the store
        takes in memory where its buffers are mappings of their own (``host_buffers``: the batch's capacity
        follows its longest row, but a row's pages past its tokens are never written)."""
        per_row = [min(held, self.capacity) for held in self.rows_held()]
        whole, by_row = self.slot_bytes()
        batch = self.count.shape[0]
        return batch * self.heads * (self.capacity + 1) * whole + sum(per_row) * self.heads * by_row
