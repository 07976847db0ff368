"""Compile every Triton kernel for a GPU (sm_90) without one: catches what only a GPU compile rejects.

The interpreter runs code a GPU compile refuses (tl.dot blocks under 16, some type mixes, scalar
tensors), so the interpreter tests alone cannot tell that the kernels build. Triton compiles to
PTX and cubin with the ptxas shipped in its wheel, no device needed. Runs in a fresh process
(TRITON_INTERPRET must be off when the kernels are defined); each compile takes a few seconds.
Also prints the shared memory each configuration needs (GPUs give one program ~100-227 KiB).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    print(proc.stdout)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _compile_all() -> int:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as exc:  # an older or newer triton without these entry points
        print(f"cannot compile ahead of time with this triton: {exc!r}")
        return 77

    from h2ochat_kernels import triton_chunk, triton_decode, triton_evict
    from h2ochat_kernels._common import MASKED

    target = GPUTarget("cuda", 90, 32)
    unit_strides = {"sqd", "skd", "svd", "snkd", "snvd", "sod", "sss", "sis", "sps", "scs", "spos"}

    def compile_one(kernel, pointers, constexprs, num_stages=3):
        fn = kernel.fn if hasattr(kernel, "fn") and not hasattr(kernel, "arg_names") else kernel
        consts = dict(constexprs)
        consts.update({name: 1 for name in fn.arg_names if name in unit_strides})
        signature = {}
        for name in fn.arg_names:
            if name in consts:
                signature[name] = "constexpr"
            elif name in pointers:
                signature[name] = pointers[name]
            elif name == "scale":
                signature[name] = "fp32"
            else:
                signature[name] = "i32"
        src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        compiled = triton.compile(src, target=target, options={"num_warps": 4, "num_stages": num_stages})
        shown = {k: v for k, v in constexprs.items() if k.startswith(("BLOCK", "HALF", "SCORE", "HAS"))}
        print(f"{fn.__name__} {shown} shared={compiled.metadata.shared} B")

    # fp16 and fp32 take different tl.dot paths (HALF_DOT); bf16 compiles like fp16 (checked once,
    # left out to keep this test short).
    for dt, half, block, stages in (("fp16", True, 64, 3), ("fp32", False, 32, 2)):
        compile_one(
            triton_decode._decode_split_kernel,
            dict(Q=f"*{dt}", K=f"*{dt}", V=f"*{dt}", SLOT="*i64", WS="*fp32", PART_M="*fp32", PART_L="*fp32",
                 PART_ACC="*fp32"),
            dict(MASKED_LOGIT=MASKED, BLOCK_G=16, BLOCK_D=128, BLOCK_S=block, SCORE=True, HALF_DOT=half), stages,
        )
        if not half:
            continue  # the fp32 chunk kernel is the slowest compile; its dot path is the decode one's
        compile_one(
            triton_chunk._chunk_kernel,
            dict(Qp=f"*{dt}", K=f"*{dt}", V=f"*{dt}", SLOT="*i64", NK=f"*{dt}", NV=f"*{dt}", VALID="*i1",
                 SCORES="*fp32", NEW_SCORES="*fp32", OUT=f"*{dt}"),
            dict(MASKED_LOGIT=MASKED, BLOCK_M=block, BLOCK_N=block, BLOCK_D=128, HAS_VALID=True, HALF_DOT=half),
            stages,
        )
    compile_one(
        triton_decode._decode_combine_kernel,
        dict(Q="*fp16", NK="*fp16", NV="*fp16", VALID="*i1", WS="*fp32", PART_M="*fp32", PART_L="*fp32",
             PART_ACC="*fp32", SCORES="*fp32", OUT="*fp16", NEW_SCORES="*fp32"),
        dict(MASKED_LOGIT=MASKED, BLOCK_G=16, BLOCK_D=128, BLOCK_S=64, BLOCK_P=8, SCORE=True, HAS_VALID=True),
    )
    compile_one(
        triton_evict._evict_kernel,
        dict(PRI="*fp32", K="*fp16", V="*fp16", SC="*fp32", IDX="*i64", POS="*i64", NK="*fp16", NV="*fp16",
             NS="*fp32", NTI="*i64", NPOS="*i64", DROPPED="*i64"),
        dict(BLOCK_S=1024, BLOCK_D=128),
    )
    print("all kernels compiled for sm_90")
    return 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(_compile_all())
