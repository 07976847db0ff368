"""``--dtype auto`` on the CPU: bf16 where the CPU multiplies bf16 natively, fp32 elsewhere."""

from __future__ import annotations

import pytest
import torch

from h2ochat_kernels import dispatch
from h2ochat.loading import native_bf16
from h2ochat.loading.models import pick_dtype

X86_FLAGS = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 avx avx2 avx512f avx512bw"


def _cpuinfo(tmp_path, flags: str, key: str = "flags") -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\n{key}\t\t: {flags}\n\nprocessor\t: 1\n")
    return str(path)


@pytest.fixture
def cpu(monkeypatch, tmp_path):
    """Make the detection read a cpuinfo with the given flags (the suite's pin lifted)."""
    monkeypatch.delenv(native_bf16.OVERRIDE, raising=False)

    read = dispatch.cpu_flags.__wrapped__  # (uncached: each test reads its own file)

    def use(flags: str, key: str = "flags"):
        path = _cpuinfo(tmp_path, flags, key)
        monkeypatch.setattr(native_bf16, "cpu_flags", lambda: read(path))
    return use


@pytest.mark.parametrize("flag", native_bf16.NATIVE_BF16_FLAGS)
def test_auto_is_bf16_on_a_cpu_with_native_bf16(cpu, flag):
    cpu(f"{X86_FLAGS} {flag}")
    assert pick_dtype("auto", "cpu") == torch.bfloat16


def test_auto_is_fp32_on_a_cpu_without_it(cpu):
    cpu(X86_FLAGS)  # avx512f alone emulates bf16 through fp32
    assert pick_dtype("auto", "cpu") == torch.float32


def test_auto_is_fp32_where_cpuinfo_is_unreadable(monkeypatch, tmp_path):
    monkeypatch.delenv(native_bf16.OVERRIDE, raising=False)
    assert dispatch.cpu_flags.__wrapped__(str(tmp_path / "absent")) == frozenset()
    monkeypatch.setattr(native_bf16, "cpu_flags", lambda: frozenset())
    assert pick_dtype("auto", "cpu") == torch.float32


def test_arm_features_line_is_read(cpu):
    cpu("fp asimd evtstrm aes pmull sha1 sha2 crc32", key="Features")
    assert pick_dtype("auto", "cpu") == torch.float32
    assert "asimd" in native_bf16.cpu_flags()


@pytest.mark.parametrize("value, expected", [("1", torch.bfloat16), ("0", torch.float32)])
def test_the_override_wins_over_the_flags(cpu, monkeypatch, value, expected):
    cpu(X86_FLAGS if value == "1" else f"{X86_FLAGS} amx_bf16")
    monkeypatch.setenv(native_bf16.OVERRIDE, value)
    assert pick_dtype("auto", "cpu") == expected


def test_an_explicit_dtype_is_kept_whatever_the_cpu(cpu):
    cpu(f"{X86_FLAGS} amx_bf16")
    assert pick_dtype("float32", "cpu") == torch.float32
    assert pick_dtype("bfloat16", "cpu") == torch.bfloat16


def test_the_suite_runs_in_fp32():
    """conftest pins the detection off: tests compare against fp32 references on every machine."""
    assert pick_dtype("auto", "cpu") == torch.float32


def test_an_explicit_bf16_model_keeps_its_own_linears_where_onednn_cannot_multiply_bf16(monkeypatch):
    """An AVX2-only CPU (no avx512bw/vl/dq, no avx_ne_convert): oneDNN's bf16 reorder raises there, so
    ``--dtype bfloat16`` packed nothing and crashed at load; now the linears stay as transformers built
    them and the model steps."""
    from conftest import build_model, random_ids
    from h2ochat.engine import packed_linears
    from h2ochat.engine.generation import CacheSettings, prefill

    monkeypatch.setattr(packed_linears, "onednn_bf16_runs", lambda: False)
    model = build_model("llama", seed=0).to(torch.bfloat16)
    assert not packed_linears.packs(torch.device("cpu"), torch.bfloat16)
    assert packed_linears.pack_linears(model) == 0 and packed_linears.pack_linears(model, 64) == 0
    assert all(type(module) is not packed_linears.PackedLinear for module in model.modules())
    with torch.inference_mode():
        logits = prefill(model, CacheSettings(budget="8").build(model), random_ids(1, 12))
    assert torch.isfinite(logits.float()).all()


def test_onednn_s_answer_matches_what_its_reorder_does():
    """``onednn_bf16_runs`` says yes exactly where the reorder it guards works on this machine."""
    from h2ochat.engine.packed_linears import onednn_bf16_runs

    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
        works = True
    except (RuntimeError, AttributeError):
        works = False
    assert onednn_bf16_runs() == works
