"""The quantised decode rows of benchmarks/bench_kernels.py and their verdict in benchmarks/gpu_check.py:
the bytes a step reads counted from the format (codes, float32 scale and offset, index, scores), the
CPU run's JSON rows beside the unquantised step, and gpu_check's PASS / MISS / N/A from them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from h2ochat_kernels import quant

ROOT = Path(__file__).resolve().parents[1]


def module(name: str):
    """A script of benchmarks/ as a module (benchmarks/ is no package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded  # (gpu_check's dataclasses resolve their annotations through it)
        spec.loader.exec_module(loaded)
    return sys.modules[name]


def test_bytes_read_per_step_follow_the_format():
    bench = module("bench_kernels")
    batch, slots, heads, dim = 2, 100, 8, 128
    n = batch * heads * slots
    # fp16 slots: K and V at 2 bytes an element; + the int64 index, + the fp32 scores read and written
    assert bench.decode_bytes(batch, slots, torch.float16, True) == n * (2 * dim * 2 + 8 + 8)
    for bits, code_bytes in ((8, dim), (4, dim // 2)):
        want = n * (2 * (code_bytes + 4 + 4) + 8 + 8)
        assert bench.decode_bytes(batch, slots, torch.float16, True, bits=bits) == want
        assert want == n * (2 * quant.bytes_per_token(dim, bits) + 16)
    assert bench.decode_bytes(batch, slots, torch.float16, False, bits=8) == n * (2 * (dim + 8) + 8)


def test_cpu_rows_time_the_reference_over_the_same_slots_quantised(seed):
    bench = module("bench_kernels")
    inp = bench.decode_inputs(1, 48, torch.float32, "cpu", group=2, kv_heads=2, head_dim=16)
    timer = bench.CpuTimer(reps=1, warmup=0)
    checked = []

    def check(q_inp, slots_q):  # the rows are made from the same keys and values, quantised
        back = quant.dequantize(q_inp["cache_keys"], slots_q.key_scale, slots_q.key_offset, slots_q.bits, 16)
        checked.append(float((back - inp["cache_keys"]).abs().max() / slots_q.key_scale.max()))
        return 0.0

    rows = bench.quant_rows(inp, torch.float32, timer, lambda q, s: bench.reference.attend_with_scores(**q, quant=s),
                            1e-3, 1e9, check=check)
    assert [r["kv_dtype"] for r in rows] == ["int8", "int4"]
    assert all(c <= 0.5 + 1e-4 for c in checked), checked  # within half a step of the slots timed unquantised
    for r in rows:
        bits = int(r["kv_dtype"][3:])
        assert r["bytes"] == 1 * 2 * 48 * (2 * quant.bytes_per_token(16, bits) + 16)
        assert r["bytes_ratio"] == pytest.approx(r["bytes"] / (1 * 2 * 48 * (2 * 16 * 4 + 16)))
        assert r["t_us"] > 0 and r["time_ratio"] == pytest.approx(r["t_us"] / 1e3)
        assert r["bytes_ratio"] < 1 and r["max_err"] == 0.0


@pytest.mark.parametrize("time_ratio, expected", [(0.30, "PASS"), (0.40, "MISS")])
def test_gpu_check_quant_verdict(tmp_path, time_ratio, expected):
    check = module("gpu_check")
    report = check.Report(tmp_path, check.GPU)
    rows = [dict(batch=16, slots=4096, kv_dtype="int8", time_ratio=time_ratio, bytes_ratio=0.3,
                 bw_fraction_of_copy=0.7),
            dict(batch=16, slots=4096, kv_dtype="int4", time_ratio=0.18, bytes_ratio=0.17, bw_fraction_of_copy=0.6),
            dict(batch=1, slots=512, kv_dtype="int8", time_ratio=5.0, bytes_ratio=0.3, bw_fraction_of_copy=0.1)]
    report.data["steps"] = {"kernel_bench": {"result": {"backend": "triton", "decode": [], "decode_quant": rows}}}
    check.evaluate(report, check.GPU)
    target = report.data["targets"]["quant_decode"]
    assert target["verdict"] == expected
    assert target["value"] == pytest.approx(max(time_ratio / 0.3, 0.18 / 0.17), abs=1e-3)  # the worse of the two
    assert "int4: 0.18x time for 0.17x bytes" in target["at"]
    # no Triton timing: not applicable
    report.data["steps"] = {"kernel_bench": {"result": {"backend": "torch", "decode_quant": rows}}}
    check.evaluate(report, check.GPU)
    assert report.data["targets"]["quant_decode"]["verdict"] == "N/A"
