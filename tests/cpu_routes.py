"""Every compiled CPU route a kernel module has, as a pytest fixture: a test that takes ``recall_route`` or
``rows_route`` runs once per variant of that module (``h2ochat_kernels.cpu.variants``), with
``H2OCHAT_CPU_KERNELS`` set to it, and is skipped, with the reason in the summary, where this CPU cannot run
the variant or the install did not build it. The torch route a test compares with is ``torch_route``'s
(``H2OCHAT_CPU_KERNELS=none``)."""

from __future__ import annotations

import os
import shutil

import pytest

from h2ochat_kernels import dispatch
from h2ochat_kernels.cpu import routes, variants


def _why_not(variant: variants.Variant) -> str:
    reason = routes.why_not(variant)  # (the dispatcher's own reason)
    return f"{variant.module} route {variant.name}: {reason}" if reason else ""


def route_params(module: str) -> list:
    return [pytest.param(v.name, id=v.name, marks=pytest.mark.skipif(bool(_why_not(v)), reason=_why_not(v) or "-"))
            for v in variants.of(module)]


def _route(monkeypatch, name: str) -> str:
    monkeypatch.setenv(dispatch.CPU_SWITCH, name)
    return name


@pytest.fixture(params=route_params("recall"))
def recall_route(request, monkeypatch):
    return _route(monkeypatch, request.param)


@pytest.fixture(params=route_params("rows"))
def rows_route(request, monkeypatch):
    return _route(monkeypatch, request.param)


@pytest.fixture(params=route_params("attention"))
def attention_route(request, monkeypatch):
    return _route(monkeypatch, request.param)


@pytest.fixture(params=route_params("block_scores"))
def block_scores_route(request, monkeypatch):
    return _route(monkeypatch, request.param)


@pytest.fixture
def torch_route(monkeypatch):
    """Call it to switch this test to the torch route (no compiled CPU kernel) from then on."""
    return lambda: _route(monkeypatch, "none")


def install_had_a_compiler() -> bool:
    """Whether a C compiler is here now, as the install would have found it ($CC, else cc or gcc; CC=false: none)."""
    command = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return bool(command) and os.path.basename(command.split()[0]) != "false"


def routes_report() -> list[str]:
    """One entry a variant: "recall/avx2: run", or "recall/avx512bf16: skipped (this CPU lacks avx512_bf16)"."""
    return [f"{v.module}/{v.name}: " + (f"skipped ({_why_not(v)})" if _why_not(v) else "run") for v in variants.VARIANTS]


@pytest.fixture
def without_attention_kernel(monkeypatch):
    """A decode step's attention on the torch route (``H2OCHAT_CPU_ATTENTION=0``, read when a cache layer chooses its
    backend: set before the test builds its caches) whatever ``H2OCHAT_CPU_KERNELS`` says, the C attention kernel
    summing in another order: for a test that holds another module's kernels to the torch route bit for bit."""
    from h2ochat_kernels.cpu import attention_ops

    monkeypatch.setenv(attention_ops.ROUTE_SWITCH, "0")
