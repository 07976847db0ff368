"""A bf16 model's linear layers on the CPU, each in the form that multiplies its step's rows fastest.

Two forms, chosen by ``pack_linears`` from the most rows a decode step multiplies:

- ``RowLinear`` (up to ``row_products.MAX_ROWS`` rows, where the CPU runs the row kernel): the weight
  stays as transformers loaded it, and one to three rows go through ``row_products.product``, which
  reads each weight once at memory speed (faster than the packed form at one row). More rows (a prompt
  chunk) take ``torch.nn.functional.linear``, which reorders the weight on the call (a little slower than
  packed at a few hundred rows, more at 64; results_packed_linears_s52_row_kernel.json).
- ``PackedLinear`` (more rows, a server's batch): the weight packed once into oneDNN's blocked layout.
  ``torch.nn.functional.linear`` on bf16 reorders the weight into that layout on every call; packed once at
  load, the same product gives the same bits (``tests/test_packed_linears.py``) in less time, most at a few
  rows (``benchmarks/packed_linears.py``, results_packed_linears.json). Where the row kernel runs and a second
  copy of the linears' weights is a small share of the free memory (``keeps_both``), the packed form also keeps
  the plain weight, and a step of one to ``row_products.MAX_ROWS`` rows (a server's lone chat) goes through the
  row kernel: the server's buckets then take each the faster product for their rows.

fp32 weights stay as they are: MKL's sgemm is as fast there, and its bits differ from oneDNN's.

Inside a compiled graph each form runs as one opaque op (``h2ochat::row_linear``, ``h2ochat::packed_linear``):
inductor has no lowering for a packed weight that is a graph input (only for the constants its own
freezing packs), and with plain linears put back the compiled one-row step ran its products through
``aten::mm``, which reorders every weight on every call (most of a SmolLM2 step). The ops are registered with
the low-level ``Library`` API, a few microseconds a call less than ``torch.library.custom_op``'s wrapper, 211
calls a step. Eager calls go straight to the product. A
weight another module shares (a head tied to the embeddings) is packed as a copy, the original kept for
the module that shares it (a ``RowLinear`` reads the shared weight itself); any other weight lives only
in its packed form, and the parameters left are copied out of the loaded file's memory map
(``_own_the_rest``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from h2ochat_kernels.cpu import row_products

from ..host_memory import free_host_bytes

ENVIRONMENT_SWITCH = "H2OCHAT_PACK_LINEARS"  # "0": leave the linears as transformers built them
_LIBRARY = torch.library.Library("h2ochat", "FRAGMENT")


def _onednn_product(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` times a weight packed by ``mkldnn._reorder_linear_weight`` (plus ``bias``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def _row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` times a plain weight: the row kernel for a few rows, torch's product for more."""
    if row_products.fits(x):
        return row_products.product(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def _packed_shape(x, packed_weight, bias, out_features, plain_weight=None):
    return x.new_empty((*x.shape[:-1], out_features))


def _row_shape(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _as_op(name: str, schema: str, product, shape) -> None:
    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, product, "CompositeExplicitAutograd")
    torch.library.register_fake(f"h2ochat::{name}", shape, lib=_LIBRARY)


def _packed_product(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                    plain_weight: torch.Tensor | None = None) -> torch.Tensor:
    """A ``PackedLinear``'s product: the row kernel on its plain weight for a few rows where it keeps one,
    else oneDNN's on the packed weight (decided per call on the rows: a compiled graph of any batch size takes
    each bucket's faster product, with no guard on the size)."""
    if plain_weight is not None and row_products.fits(x):
        return row_products.product(x, plain_weight, bias)
    return _onednn_product(x, packed_weight, bias)


_as_op("packed_linear", "(Tensor x, Tensor packed_weight, Tensor? bias, SymInt out_features, Tensor? plain_weight) "
       "-> Tensor", lambda x, packed_weight, bias, out_features, plain_weight: _packed_product(
           x, packed_weight, bias, plain_weight), _packed_shape)
_as_op("row_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _row_product, _row_shape)


def _holding(linear_type: type[nn.Linear], weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """A ``linear_type`` (``nn.Linear`` or a subclass) holding these very parameters (no copy)."""
    linear = linear_type(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.register_parameter("weight", weight)
    linear.register_parameter("bias", bias)
    return linear


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight in oneDNN's packed layout (a non-persistent buffer); with ``few_rows``, the
    plain weight kept beside it for the row kernel's few-row products (``_packed_product``)."""

    def __init__(self, linear: nn.Linear, shared: bool, few_rows: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()),
                             persistent=False)
        self.bias = linear.bias
        # (tuples: a Parameter assigned to a module attribute would be registered as this module's)
        self._shared_weight = (linear.weight,) if shared else None
        self._plain_weight = None
        if few_rows:  # (its own memory, unless shared: a view of the loaded file's memory map keeps the map resident)
            plain = linear.weight.detach()
            self._plain_weight = (plain if shared and plain.is_contiguous() else plain.clone(),)

    @property
    def plain_weight(self) -> torch.Tensor | None:
        """The plain weight the few-row products read (None: every product is the packed one)."""
        return self._plain_weight[0] if self._plain_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.h2ochat.packed_linear(x, self.packed_weight, self.bias, self.out_features,
                                                   self.plain_weight)
        return _packed_product(x, self.packed_weight, self.bias, self.plain_weight)

    def unpacked(self) -> nn.Linear:
        """The plain ``nn.Linear`` with the same weight (the shared one itself, when it was shared)."""
        if self._shared_weight:
            weight = self._shared_weight[0]
        else:
            plain = self.plain_weight if self.plain_weight is not None else self.packed_weight.to_dense()
            weight = nn.Parameter(plain, requires_grad=False)
        return _holding(nn.Linear, weight, self.bias)

    def extra_repr(self) -> str:
        few = ", row kernel at few rows" if self._plain_weight else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed{few}")


class RowLinear(nn.Linear):
    """``nn.Linear`` whose few-row products go through the row kernel (``row_products``), its weight
    the one transformers loaded (a tied one shared as it was)."""

    @classmethod
    def reading(cls, linear: nn.Linear) -> "RowLinear":
        """A ``RowLinear`` holding ``linear``'s own parameters (the kernel reads the weight's rows whole)."""
        weight = linear.weight
        if not weight.is_contiguous():  # (a copy: a weight tied elsewhere is no longer shared then)
            weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        return _holding(cls, weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.h2ochat.row_linear(x, self.weight, self.bias)
        return _row_product(x, self.weight, self.bias)

    def plain(self) -> nn.Linear:
        """The plain ``nn.Linear`` with the same parameters."""
        return _holding(nn.Linear, self.weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", row kernel"


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``pack_linears`` packs a model on ``device`` in ``dtype``: bf16 on the CPU, with oneDNN
    and a CPU its bf16 path runs on (and the switch not set to 0)."""
    return (os.environ.get(ENVIRONMENT_SWITCH, "1") != "0" and torch.device(device).type == "cpu"
            and dtype == torch.bfloat16 and onednn_bf16_runs())


def onednn_bf16_runs() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU: its reorder refuses a CPU without avx512bw/vl/dq or
    avx_ne_convert (an AVX2-only EPYC), where a bf16 model keeps transformers' own linears."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def _replace_modules(model: nn.Module, replace) -> int:
    """Every submodule ``m`` for which ``replace(m)`` returns a module swapped for it; how many were."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = replace(child)
            if new is not None:
                parent.register_module(name, new)
                count += 1
    return count


def form_for(rows: int) -> type[nn.Module]:
    """The linear form for decode steps of at most ``rows`` rows: ``RowLinear`` where the row kernel runs
    and takes that many, else ``PackedLinear``."""
    return RowLinear if rows <= row_products.MAX_ROWS and row_products.available() else PackedLinear


def _plain(module: nn.Module) -> nn.Linear | None:
    """``module`` as a plain bf16 ``nn.Linear`` (the same parameters), or None for any other module."""
    if isinstance(module, PackedLinear):
        return module.unpacked()
    if type(module) in (nn.Linear, RowLinear) and module.weight.dtype == torch.bfloat16:
        return module
    return None


# a packed model keeps its plain linear weights too (for the row kernel's few-row steps) while they take at most
# this share of the free host memory
KEEP_BOTH_SHARE = 1 / 8
KEEP_BOTH_SWITCH = "H2OCHAT_KEEP_PLAIN_WEIGHTS"  # "0": the packed form alone, whatever the memory


def keeps_both(model: nn.Module) -> bool:
    """Whether ``model``'s packed linears also keep their plain weights: the row kernel runs here, and the plain
    weights of its linears are at most ``KEEP_BOTH_SHARE`` of the free host memory (a small model on a laptop
    yes, a 7B model's second copy of 13 GB no), and ``H2OCHAT_KEEP_PLAIN_WEIGHTS`` is not 0."""
    if os.environ.get(KEEP_BOTH_SWITCH, "1") == "0" or not row_products.available():
        return False
    plain = sum(m.in_features * m.out_features * 2 for m in model.modules()  # (bf16 weights, in any form)
                if isinstance(m, PackedLinear) or (type(m) in (nn.Linear, RowLinear) and m.weight.dtype == torch.bfloat16))
    return plain <= KEEP_BOTH_SHARE * free_host_bytes()


def pack_linears(model: nn.Module, rows: int = 1) -> int:
    """Every bf16 linear of ``model`` (on the CPU) put in ``form_for(rows)``, in place, whatever form it
    was in (the packed form keeping the plain weights too where ``keeps_both``); returns how many were
    swapped. A model ``packs`` says no to is left alone (0)."""
    parameter = next(model.parameters(), None)
    if parameter is None or not packs(parameter.device, parameter.dtype):
        return 0
    form = form_for(rows)
    few_rows = form is PackedLinear and keeps_both(model)
    uses: dict[int, int] = {}
    for module in model.modules():
        held = list(module.parameters(recurse=False))
        if isinstance(module, PackedLinear) and module._shared_weight:
            held.append(module._shared_weight[0])
        for tensor in held:
            uses[id(tensor)] = uses.get(id(tensor), 0) + 1

    def swapped(module):
        done = isinstance(module, form) and (form is RowLinear or (module.plain_weight is not None) == few_rows)
        linear = None if done else _plain(module)
        if linear is None:
            return None
        if form is RowLinear:
            return RowLinear.reading(linear)
        return PackedLinear(linear, shared=uses.get(id(linear.weight), 0) > 1, few_rows=few_rows)

    with torch.no_grad():
        count = _replace_modules(model, swapped)
        if count:
            _own_the_rest(model)
    return count


def _own_the_rest(model: nn.Module) -> None:
    """The parameters left (embeddings, norms) copied into memory of their own, in place (a tied weight
    stays one Parameter): transformers loads a safetensors file as views of one memory map, and while any
    view of it lives every page the packing read stays in the process's RSS (SmolLM2 in bf16: 994 MB
    after the load, 789 MB with the map released)."""
    seen: set[int] = set()
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            parameter.set_(parameter.detach().clone())


def unpack_linears(model: nn.Module) -> int:
    """Every ``PackedLinear`` and ``RowLinear`` of ``model`` back to a plain ``nn.Linear`` (the same
    weights); how many were."""
    def plain(module):
        if isinstance(module, PackedLinear):
            return module.unpacked()
        return module.plain() if isinstance(module, RowLinear) else None

    with torch.no_grad():
        return _replace_modules(model, plain)


def form_of(model: nn.Module) -> str:
    """The form ``model``'s linears are in, for records and log lines: "row kernel", "packed" (", row kernel at
    1-3 rows" where it keeps the plain weights too) or "plain"."""
    kinds = {type(module) for module in model.modules()}
    if RowLinear in kinds:
        return "row kernel"
    if PackedLinear not in kinds:
        return "plain"
    both = any(isinstance(m, PackedLinear) and m.plain_weight is not None for m in model.modules())
    return f"packed, row kernel at 1-{row_products.MAX_ROWS} rows" if both else "packed"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s weights: its parameters and its packed weights (a shared one counted once
    in each form it is held in)."""
    packs = [module for module in model.modules() if isinstance(module, PackedLinear)]
    packed = sum(module.packed_weight.numel() * module.packed_weight.element_size() for module in packs)
    # a plain weight kept beside its packed one (not a parameter, unless shared: then counted once, as one)
    kept = sum(module.plain_weight.numel() * module.plain_weight.element_size() for module in packs
               if module.plain_weight is not None and not module._shared_weight)
    return packed + kept + sum(p.numel() * p.element_size() for p in model.parameters())
