"""A bf16 model's linear layers on the CPU, with their weights packed once into oneDNN's blocked layout.

``torch.nn.functional.linear`` on bf16 CPU tensors already runs oneDNN's matrix product, but it
reorders the weight into oneDNN's layout on every call. Packed once at load (``pack_linears``), the
same product gives the same bits (``tests/test_packed_linears.py``) and, measured on this 2-core AMD
EPYC (avx512_bf16, one thread; ``benchmarks/packed_linears.py``), SmolLM2-135M's 211 linears take
1.6-1.8x less time at 1-8 rows (a decode step: the weights are read once per step, and the reorder
was most of it) and ~1.1x less at 300 (a prompt chunk). fp32 weights stay as they are: MKL's sgemm
is as fast there, and its bits differ from oneDNN's.

Inside a compiled graph (``compiled``) the packed product runs as the opaque op ``h2ochat::packed_linear``:
inductor has no lowering for a packed weight that is a graph input (only for the constants its own
freezing packs), and with plain linears put back the compiled one-row step ran its products through
``aten::mm``, which reorders every weight on every call (34 of a 41.5 ms SmolLM2 step, against ~23 ms
packed). Eager calls oneDNN directly: the op's Python dispatch adds ~5 us a call. A weight another module shares (a head tied to the
embeddings) is packed as a copy, the original kept for the module that shares it; any other weight
lives only in its packed form, and the parameters left are copied out of the loaded file's memory map
(``_own_the_rest``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

ENVIRONMENT_SWITCH = "H2OCHAT_PACK_LINEARS"  # "0": leave the linears as transformers built them


def _onednn_product(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` times a weight packed by ``mkldnn._reorder_linear_weight`` (plus ``bias``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@torch.library.custom_op("h2ochat::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """``_onednn_product`` as one op a compiled graph calls without looking inside."""
    return _onednn_product(x, packed_weight, bias)


@packed_linear.register_fake
def _packed_linear_shape(x, packed_weight, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight in oneDNN's packed layout (a non-persistent buffer)."""

    def __init__(self, linear: nn.Linear, shared: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()),
                             persistent=False)
        self.bias = linear.bias
        # (a tuple: a Parameter assigned to a module attribute would be registered as this module's)
        self._shared_weight = (linear.weight,) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.packed_weight, self.bias, self.out_features)
        return _onednn_product(x, self.packed_weight, self.bias)

    def unpacked(self) -> nn.Linear:
        """The plain ``nn.Linear`` with the same weight (the shared one itself, when it was shared)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device="meta", dtype=self.packed_weight.dtype)
        weight = self._shared_weight[0] if self._shared_weight else nn.Parameter(self.packed_weight.to_dense(),
                                                                                 requires_grad=False)
        linear.register_parameter("weight", weight)
        linear.register_parameter("bias", self.bias)
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``pack_linears`` packs a model on ``device`` in ``dtype``: bf16 on the CPU, with oneDNN
    (and the switch not set to 0)."""
    return (os.environ.get(ENVIRONMENT_SWITCH, "1") != "0" and torch.device(device).type == "cpu"
            and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


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


def pack_linears(model: nn.Module) -> int:
    """Every ``nn.Linear`` of ``model`` (bf16, on the CPU) swapped for a ``PackedLinear``, in place;
    returns how many were. A model ``packs`` says no to is left alone (0)."""
    parameter = next(model.parameters(), None)
    if parameter is None or not packs(parameter.device, parameter.dtype):
        return 0
    uses: dict[int, int] = {}
    for module in model.modules():
        for tensor in module.parameters(recurse=False):
            uses[id(tensor)] = uses.get(id(tensor), 0) + 1

    def packed(module):
        if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16:
            return PackedLinear(module, shared=uses[id(module.weight)] > 1)
        return None

    with torch.no_grad():
        count = _replace_modules(model, packed)
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
    """Every ``PackedLinear`` of ``model`` back to a plain ``nn.Linear`` (the same bits); how many were."""
    with torch.no_grad():
        return _replace_modules(model, lambda module: module.unpacked() if isinstance(module, PackedLinear) else None)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s weights: its parameters and its packed weights (a shared one counted once
    in each form it is held in)."""
    packed = sum(module.packed_weight.numel() * module.packed_weight.element_size()
                 for module in model.modules() if isinstance(module, PackedLinear))
    return packed + sum(p.numel() * p.element_size() for p in model.parameters())
