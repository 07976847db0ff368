"""The one place every kernel route is chosen.

- GPU work: the Triton kernels or their torch references, once per cache layer (``backend_for``), or per
  call (the module-level functions, for callers without a layer: tests, the simulation); the cold store's
  zero-copy row kernels (``host_rows``).
- CPU work: which compiled variant of a C kernel module runs (``cpu_route``, ``cpu_checked``): the best one
  the CPU supports among those the install built (``cpu.variants``), or none (the torch route).

``H2OCHAT_KERNELS`` (read when a backend is chosen):

- ``auto`` (default): Triton when the tensors are on CUDA and ``triton`` imports, else torch;
- ``torch``: always the reference;
- ``triton``: always Triton; an error when triton is missing, or when the tensors are on the CPU and
  the Triton interpreter is off (``TRITON_INTERPRET=1`` makes CPU tensors work, slowly: tests).

``H2OCHAT_CPU_KERNELS`` (read when a CPU route is asked for):

- ``auto`` (default): the best variant of the module that this CPU runs and the install built;
- a variant's name (``avx512bf16``, ``avx2``, ``generic``): that one, or none where the CPU or the install
  lacks it (tests run every route this way);
- ``none``: no compiled CPU kernel, the torch route for everything.

The torch backend sends a CPU step's attention and scores over float slots (a decode step's token, or a prompt
chunk's up to 512) through the C attention kernel (``cpu.attention_ops``) wherever a variant of it loads, in eager
steps and in compiled ones (there as the custom op ``torch.ops.h2ochat.cpu_attend_with_scores``), so both take the
same route. ``H2OCHAT_CPU_ATTENTION=0`` keeps
the torch route (read when a cache layer chooses its backend); so does ``H2OCHAT_CPU_KERNELS=none``.

A C kernel changes speed only: each route gives the torch route's results, bit for bit where the test of its
module says so and within the stated tolerance where it sums in another order.

Triton modules are imported lazily, on the first Triton call, so importing this package never needs
triton or a GPU. A call the kernels do not cover (head_dim > 256, mixed cache dtypes, non-float inputs,
an empty cache for eviction, a value-norm rank without the norms, quantised slots whose new tokens are
not in the query's dtype) runs the reference instead, whatever the backend. The score decay of
``attend_with_scores`` (a float or one per sequence), its quantised slots (``quant=`` a
``quant.QuantSlots``: int8 / int4 codes with their scales and offsets) and the policy eviction
``evict_by_policy`` run in the kernels too. The evictions take an ``active`` row mask ([B] bool, None:
every row): a row left out writes nothing (a decode step's finished rows).

A Triton call goes through ``ops``: the launcher itself when eager, the ``torch.ops.h2ochat.*``
custom op inside a ``torch.compile`` trace (one opaque node per launch, its writes declared).
Dynamo does not guard on ``H2OCHAT_KERNELS``: a compiled graph keeps the backend it was traced with
(``torch._dynamo.reset()`` after changing it in one process).
"""

from __future__ import annotations

import numbers
import os

import torch

from . import ops, recall_reference, reference
from .cpu import attention_ops
from .cpu.routes import (CPU_CHOICES, CPU_SWITCH, cpu_checked, cpu_flags, cpu_route, cpu_runs,  # noqa: F401
                         cpu_wanted)

_CHOICES = ("auto", "torch", "triton")


_triton_importable: bool | None = None


def triton_available() -> bool:
    # a module global rather than functools.lru_cache: a compiled decode step reads it, and dynamo
    # warns about (and traces through) an lru_cache wrapper
    global _triton_importable
    if _triton_importable is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
        except Exception:  # ImportError, or a broken install raising something else at import
            _triton_importable = False
        else:
            _triton_importable = True
    return _triton_importable


def _triton_library_interpreted() -> bool:
    """Whether triton's own jit library (tl.zeros, tl.sum, ...) was built for the interpreter; it is
    only when TRITON_INTERPRET=1 was set before triton was first imported."""
    import triton.language as tl

    return type(tl.zeros).__name__ == "InterpretedFunction"


def kernel_backend(device: torch.device | str) -> str:
    """'triton' or 'torch' for tensors on ``device``, honouring H2OCHAT_KERNELS."""
    device = torch.device(device)
    wanted = os.environ.get("H2OCHAT_KERNELS", "auto").strip().lower() or "auto"
    if wanted not in _CHOICES:
        raise ValueError(f"H2OCHAT_KERNELS={wanted!r}: expected one of {', '.join(_CHOICES)}")
    if wanted == "torch":
        return "torch"
    if wanted == "triton":
        if not triton_available():
            raise RuntimeError("H2OCHAT_KERNELS=triton but the triton package cannot be imported")
        if device.type != "cuda":
            from ._common import interpreting  # imports triton: only here, where triton is wanted

            if not interpreting():
                raise RuntimeError(
                    f"H2OCHAT_KERNELS=triton with tensors on {device.type}: Triton runs CUDA tensors, "
                    "or CPU tensors under TRITON_INTERPRET=1 (slow; for tests)"
                )
            if not _triton_library_interpreted():
                raise RuntimeError(
                    "H2OCHAT_KERNELS=triton on the CPU: TRITON_INTERPRET=1 was set after triton was first "
                    "imported (transformers imports it); set it before any import"
                )
        return "triton"
    return "triton" if device.type == "cuda" and triton_available() else "torch"


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _attention_supported(query, cache_keys, cache_values, new_keys, new_values, scores, quant=None) -> bool:
    if quant is not None:  # codes, and new tokens in the query's dtype (the kernels' dots take one dtype)
        return (
            query.dtype in _FLOATS
            and new_keys.dtype == new_values.dtype == query.dtype
            and cache_keys.dtype == cache_values.dtype == torch.uint8
            and quant.bits in (4, 8)
            and quant.key_dim == quant.value_dim == query.shape[-1]
            and all(t.dtype == torch.float32 for t in quant[1:5])
            and scores.dtype == torch.float32
            and query.shape[-1] <= 256
        )
    dtypes = {cache_keys.dtype, cache_values.dtype, new_keys.dtype, new_values.dtype}
    return (
        query.dtype in _FLOATS
        and len(dtypes) == 1
        and cache_keys.dtype in _FLOATS
        and scores.dtype == torch.float32
        and query.shape[-1] <= 256
    )


class Backend:
    """The kernels one cache layer runs, chosen once when it allocates (``backend_for``): attention
    with scores, the decode-step evictions and the recall digest's page scores. ``name`` is "torch"
    (the references in ``reference``/``recall_reference``, what the CPU runs) or "triton" (the
    kernels through ``ops``; a call they do not cover runs the reference instead). A compiled step
    keeps the backend its layer chose: Dynamo reads no environment variable in the step."""

    def __init__(self, name: str):
        self.name = name
        self.triton = name == "triton"
        # read here, once: a compiled step keeps the route its layer chose, as an eager one does
        self.cpu_attention = name == "torch" and attention_ops.routed() and attention_ops.available()

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"

    def attend_with_scores(self, query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid,
                           scale, scores, decay=1.0, quant=None, rest=None):
        """``reference.attend_with_scores`` (same arguments, same results; ``quant`` a
        ``quant.QuantSlots`` when the slots hold int8 / int4 codes; a ``rest`` column: the reference's and
        the CPU kernel's, not the Triton kernels')."""
        args = (query, cache_keys, cache_values, slot_token_index, new_keys, new_values, new_valid, scale, scores, decay)
        if (self.triton and rest is None
                and _attention_supported(query, cache_keys, cache_values, new_keys, new_values, scores, quant)):
            return ops.attend_with_scores(*args, quant=quant)
        if self.cpu_attention and quant is None:
            # a CPU decode step or prompt chunk: the C kernel where it takes these (None: the reference)
            done = attention_ops.attend_with_scores(*args, rest=rest)
            if done is not None:
                return done
        return reference.attend_with_scores(*args, quant=quant, rest=rest)

    def attends_every_column(self, q_len: int, in_use: int, columns: int, slots) -> bool:
        """Whether this backend's attention would rather read all ``columns`` slot columns (the empty ones
        masked) than a view of the first ``in_use``: ``reference.attends_every_column`` for the torch
        path; the Triton kernels and the C attention kernel take the view as it is."""
        return not self.triton and not self.cpu_attention and reference.attends_every_column(q_len, in_use, columns,
                                                                                            slots)

    def evict_and_insert(self, priority, keys, values, scores, slot_token_index, slot_position, new_key, new_value,
                         new_score, new_token_index, new_position, value_norm=None, new_value_norm=None, active=None,
                         *, coordinates=None):
        """``reference.evict_and_insert`` (see triton_evict for the kernel). ``coordinates`` are the
        reference's (``reference.slot_coordinates``): the kernel addresses slots itself."""
        args = (priority, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                new_token_index, new_position, value_norm, new_value_norm, active)
        if self.triton and priority.is_floating_point() and _eviction_supported(
                keys, values, scores, slot_token_index, slot_position, value_norm, new_value_norm):
            return ops.evict_and_insert(*args)
        return reference.evict_and_insert(*args, coordinates=coordinates)

    def evict_by_policy(self, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                        new_token_index, new_position, value_norm=None, new_value_norm=None, active=None, *, recent,
                        sinks, oldest_first=False, by_age=False, value_eps=None, coordinates=None):
        """``reference.evict_by_policy`` (priority from the policy's parameters, argmin, in-place
        write): one Triton launch on CUDA (``triton_evict``)."""
        args = (keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                new_token_index, new_position, value_norm, new_value_norm, active)
        policy = dict(recent=recent, sinks=sinks, oldest_first=oldest_first, by_age=by_age, value_eps=value_eps)
        if (self.triton and _int_or_int_tensor(recent) and _int_or_int_tensor(sinks)
                and (value_eps is None or oldest_first or value_norm is not None)
                and _eviction_supported(keys, values, scores, slot_token_index, slot_position, value_norm,
                                        new_value_norm)):
            return ops.evict_by_policy(*args, **policy)
        return reference.evict_by_policy(*args, **policy, coordinates=coordinates)

    def lowest_slots(self, priority):
        """``reference.lowest_slots``: the victim a tier archives before it is overwritten (one argmin on
        any device: no kernel is faster)."""
        return reference.lowest_slots(priority)

    def write_slots(self, slot, keys, values, scores, slot_token_index, slot_position, new_key, new_value, new_score,
                    new_token_index, new_position, value_norm=None, new_value_norm=None, active=None, *,
                    coordinates=None):
        """``reference.write_slots``: the new token into the victim ``lowest_slots`` chose (a tier's eviction,
        which must see the victim first). In-place index writes on every device; a compiled step keeps them in
        place."""
        return reference.write_slots(slot, keys, values, scores, slot_token_index, slot_position, new_key, new_value,
                                     new_score, new_token_index, new_position, value_norm, new_value_norm, active,
                                     coordinates=coordinates)

    def page_scores(self, queries, codes, scale, offset, valid, page, bits=None):
        """``recall_reference.page_scores``: the best q.k per page from packed codes (the Triton
        kernel for power-of-two pages)."""
        if self.triton and not page & (page - 1):
            return ops.page_scores(queries, codes, scale, offset, valid, page, bits)
        return recall_reference.page_scores(queries, codes, scale, offset, valid, page, bits)


def backend_for(device: torch.device | str) -> Backend:
    """The backend for tensors on ``device``, honouring H2OCHAT_KERNELS (read here, once)."""
    return Backend(kernel_backend(device))


def _eviction_supported(keys, values, scores, slot_token_index, slot_position, value_norm, new_value_norm) -> bool:
    return (
        keys.shape[2] > 0
        and keys.shape[3] <= 1024
        and keys.dtype in _FLOATS
        and values.dtype in _FLOATS
        and scores.dtype == torch.float32
        and slot_token_index.dtype == torch.int64
        and slot_position.dtype == torch.int64
        and (value_norm is None or (value_norm.dtype == torch.float32 and new_value_norm is not None))
    )


def _int_or_int_tensor(value) -> bool:
    return not value.is_floating_point() if isinstance(value, torch.Tensor) else isinstance(value, numbers.Integral)


# -- per call: the backend of the tensors' device, chosen anew each time --------------------------------
def attend_with_scores(query, *args, **kwargs):
    return backend_for(query.device).attend_with_scores(query, *args, **kwargs)


def evict_and_insert(priority, keys, *args, **kwargs):
    return backend_for(keys.device).evict_and_insert(priority, keys, *args, **kwargs)


def evict_by_policy(keys, *args, **kwargs):
    return backend_for(keys.device).evict_by_policy(keys, *args, **kwargs)


def zero_copy_rows(device: torch.device | str) -> bool:
    """Whether a cold store serving ``device`` reads and writes its pinned host buffers from the step directly
    (``row_kernels``): CUDA with Triton, where the one-time probe of ``triton_rows.zero_copy_works`` passed.
    Elsewhere the store copies through torch."""
    device = torch.device(device)
    if device.type != "cuda" or kernel_backend(device) != "triton":
        return False
    return row_kernels().zero_copy_works(device)


def row_kernels():
    """The zero-copy row kernels (``triton_rows``: ``scatter_rows_``, ``gather_rows``), imported on first use."""
    from . import triton_rows

    return triton_rows
