"""Compile for a GPU (sm_90), without one, every Triton kernel variant the launchers launch: catches
what only a GPU compile rejects.

The variants are not listed by hand. The launchers are called as a GPU step calls them, on fake CUDA
tensors (torch's FakeTensorMode: shapes, strides, dtypes, no data) with every kernel replaced by a
recorder, and each distinct (kernel, argument types, constexprs, launch options) they would launch
is then compiled. The calls come from the policies themselves (``h2ochat.policies.POLICIES``): for
each evicting policy its decode step (decode attention with the policy's score decay, then its
eviction: the fused ``evict_by_policy`` with its rank flags, recent window and sinks, or
``evict_and_insert`` with a priority for a policy with its own rank) and its prefill chunk, in fp16
and bf16 (the GPU default: ``pick_dtype`` takes bf16 where supported), at head_dim 128 (and 64 for
the default policy) and the default budget (20% of 4096 tokens: 819 slots); the full cache's attention without eviction;
the decode step of a burst with rows left out (an ``active`` mask: the attention's ``new_valid``, the
eviction's ``HAS_ACTIVE``), for every policy in bf16; the decode step and chunk over int8 and int4
slots (``KV_BITS``) in fp16, bf16 and fp32; and the neighbours a GPU also meets: fp32 (the
"ieee" dot path), a padded batch (``new_valid``), and eval's mixed rows (per-sequence decay, recent
window and sinks).

The interpreter runs code a GPU compile refuses (tl.dot blocks under 16, some type mixes, scalar
tensors), so the interpreter tests alone cannot tell that the kernels build. Triton compiles to PTX
and cubin with the ptxas shipped in its wheel, no device needed. Runs in a fresh process
(TRITON_INTERPRET must be off when the kernels are defined). Also prints the shared memory each
variant needs (GPUs give one program ~100-227 KiB).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

DEFAULT_SLOTS = 819  # --budget 0.2 of a 4096-token model
HEAD_DIMS = (64, 128)
DTYPES = ("float16", "bfloat16")


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=900)
    print(proc.stdout)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    variants = [json.loads(line[len("variant "):]) for line in proc.stdout.splitlines() if line.startswith("variant ")]

    def launched(kernel, **want):
        return [v for v in variants if v["kernel"] == kernel
                and all(v["constexprs"].get(k, v["signature"].get(k)) == w for k, w in want.items())]

    # the default GPU decode step (h2o in bf16) and the other default policies' evictions were compiled
    assert launched("_decode_split_kernel", K="*bf16", HALF_DOT=True, BLOCK_D=128)
    assert launched("_decode_combine_kernel", OUT="*bf16", DECAY=False, HAS_VALID=False)
    assert launched("_evict_kernel", K="*bf16", RANK=1, BY_AGE=False, VALUE_EPS=False, HAS_NORM=False,
                    RECENT_PER_ROW=False, BLOCK_S=1024)
    assert launched("_evict_kernel", K="*bf16", RANK=2, RECENT_PER_ROW=False)  # local, sink
    assert launched("_evict_kernel", K="*bf16", RANK=1, BY_AGE=True)  # mean
    assert launched("_evict_kernel", K="*fp16", RANK=0)  # random: a priority given
    assert launched("_decode_combine_kernel", OUT="*bf16", DECAY=True, DECAY_PER_ROW=False)  # decay, tova
    assert launched("_chunk_kernel", OUT="*bf16", DECAY=False, HAS_VALID=False)
    assert launched("_decay_scores_kernel")
    assert launched("_decode_split_kernel", K="*fp32", HALF_DOT=False)
    # a burst's decode step, rows left out: the attention sees them as padding, the eviction skips them
    assert launched("_decode_combine_kernel", OUT="*bf16", DECAY=False, HAS_VALID=True)
    assert launched("_decode_combine_kernel", OUT="*bf16", DECAY=True, HAS_VALID=True)
    assert launched("_evict_kernel", K="*bf16", RANK=1, BY_AGE=False, HAS_ACTIVE=True)
    assert launched("_evict_kernel", K="*bf16", RANK=2, HAS_ACTIVE=True)
    assert launched("_evict_kernel", K="*bf16", RANK=0, HAS_ACTIVE=True)
    # quantised slots: uint8 codes, dequantised in the decode split kernel and in the chunk kernel
    for bits in (8, 4):
        assert launched("_decode_split_kernel", K="*u8", Q="*bf16", KV_BITS=bits, HALF_DOT=True, BLOCK_D=128)
        assert launched("_decode_split_kernel", K="*u8", Q="*fp16", KV_BITS=bits, HALF_DOT=True, BLOCK_D=64)
        assert launched("_chunk_kernel", K="*u8", OUT="*bf16", KV_BITS=bits, HALF_DOT=True)
    assert launched("_decode_split_kernel", K="*u8", Q="*fp32", KV_BITS=4, HALF_DOT=False)
    assert launched("_decode_split_kernel", K="*bf16", KV_BITS=0)  # the float slots' variant is unchanged


# -- the compile, in a fresh process ------------------------------------------------------------------

POINTER_TYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "int64": "*i64", "int32": "*i32",
                 "bool": "*i1", "uint8": "*u8"}


class Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` notes the launch."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def launch_scenarios():
    """(label, call) pairs: each call runs the launchers as one GPU step would, on fake CUDA tensors."""
    import torch

    from h2ochat.policies import DEFAULT_POLICY, POLICIES
    from h2ochat_kernels import triton_chunk, triton_decode, triton_evict

    dev = torch.device("cuda:0")

    def step(policy, dtype, head_dim, *, batch=1, kv_heads=8, group=4, slots=DEFAULT_SLOTS, q_len=24, padded=False,
             per_row=False, masked=False):
        def empty(*shape, dt=dtype):
            return torch.empty(*shape, dtype=dt, device=dev)

        kv = [empty(batch, kv_heads, slots, head_dim) for _ in range(2)]
        index = empty(batch, kv_heads, slots, dt=torch.int64)
        scores = empty(batch, kv_heads, slots, dt=torch.float32)
        budget = policy.split(slots)
        decay, recent, sinks = policy.decay, budget.recent, budget.sinks
        if per_row:  # eval's mixed rows: one value per sequence
            decay = torch.full((batch,), policy.decay, device=dev)
            recent, sinks = (torch.full((batch,), v, dtype=torch.int64, device=dev) for v in (recent, sinks))
        for q in (1, q_len):  # a decode step, then a prefill chunk
            # a decode step with rows left out (an active mask: generation.stream's bursts) sees them
            # as padding tokens
            valid = torch.ones(batch, q, dtype=torch.bool, device=dev) if padded or (masked and q == 1) else None
            launcher = triton_decode.decode_attend_with_scores if q == 1 else triton_chunk.chunk_attend_with_scores
            launcher(empty(batch, kv_heads, group, q, head_dim), *kv, index, empty(batch, kv_heads, q, head_dim),
                     empty(batch, kv_heads, q, head_dim), valid, head_dim ** -0.5, scores, decay=decay)
        if not policy.evicts:
            return
        norm = (empty(batch, kv_heads, slots, dt=torch.float32), empty(batch, kv_heads, dt=torch.float32)) \
            if policy.uses_value_norm else (None, None)
        new = (empty(batch, kv_heads, 1, head_dim), empty(batch, kv_heads, 1, head_dim),
               empty(batch, kv_heads, dt=torch.float32), empty(batch, dt=torch.int64), empty(batch, dt=torch.int64))
        state = (*kv, scores, index, empty(batch, kv_heads, slots, dt=torch.int64))
        active = torch.ones(batch, dtype=torch.bool, device=dev) if masked else None
        if policy.fused_eviction is not None:
            triton_evict.evict_by_policy(*state, *new, *norm, active, recent=recent, sinks=sinks,
                                         **policy.fused_eviction)
        else:  # its own rank (random): the cache computes a priority, the kernel takes it
            triton_evict.evict_and_insert(empty(batch, kv_heads, slots, dt=torch.float32), *state, *new, *norm,
                                          active)

    def quant_step(dtype, head_dim, bits, *, batch=2, kv_heads=8, group=4, slots=DEFAULT_SLOTS, q_len=24):
        """A decode step and a prefill chunk over int8 / int4 slots (codes, float32 scale and offset)."""
        from h2ochat_kernels.quant import QuantSlots, code_width

        width = code_width(head_dim, bits)
        codes = [torch.empty(batch, kv_heads, slots, width, dtype=torch.uint8, device=dev) for _ in range(2)]
        quant = QuantSlots(bits, *(torch.empty(batch, kv_heads, slots, device=dev) for _ in range(4)), head_dim,
                           head_dim)
        index = torch.empty(batch, kv_heads, slots, dtype=torch.int64, device=dev)
        scores = torch.empty(batch, kv_heads, slots, dtype=torch.float32, device=dev)
        for q in (1, q_len):
            launcher = triton_decode.decode_attend_with_scores if q == 1 else triton_chunk.chunk_attend_with_scores
            new = [torch.empty(batch, kv_heads, q, head_dim, dtype=dtype, device=dev) for _ in range(2)]
            launcher(torch.empty(batch, kv_heads, group, q, head_dim, dtype=dtype, device=dev), *codes, index, *new,
                     None, head_dim ** -0.5, scores, decay=1.0, quant=quant)

    scenarios = []
    for dtype in DTYPES:  # quantised slots (--kv-dtype int8 / int4)
        for head_dim in HEAD_DIMS:
            for bits in (8, 4):
                scenarios.append((f"int{bits} slots {dtype} head_dim {head_dim}",
                                  lambda d=getattr(torch, dtype), h=head_dim, b=bits: quant_step(d, h, b)))
    scenarios.append(("int4 slots float32 (ieee dots)", lambda: quant_step(torch.float32, 128, 4)))
    for name, policy in POLICIES.items():
        for dtype in DTYPES:
            # head_dim only changes the BLOCK_D tile: both for the default policy, 128 for the others
            for head_dim in HEAD_DIMS if name == DEFAULT_POLICY else HEAD_DIMS[-1:]:
                scenarios.append((f"{name} {dtype} head_dim {head_dim}",
                                  lambda p=policy, d=getattr(torch, dtype), h=head_dim: step(p, d, h)))
        # the decode step of a burst (chat, generate, story with stop ids; every compiled step): rows left out
        scenarios.append((f"{name} bfloat16 burst (rows left out)",
                          lambda p=policy: step(p, torch.bfloat16, 128, batch=2, masked=True)))
    h2o, mean = POLICIES["h2o"], POLICIES["mean"].with_knobs(value_eps=0.1, decay=0.9)
    scenarios += [
        ("h2o float32 (ieee dots)", lambda: step(h2o, torch.float32, 128)),
        ("h2o bfloat16 padded batch", lambda: step(h2o, torch.bfloat16, 128, batch=4, padded=True)),
        ("mean+decay+value_eps bfloat16 mixed rows", lambda: step(mean, torch.bfloat16, 128, batch=4, per_row=True)),
        ("h2o bfloat16 batch 16 x 4096 slots", lambda: step(h2o, torch.bfloat16, 128, batch=16, slots=4096)),
    ]
    return scenarios


def signature_of(kernel, args, kwargs):
    """(signature, constexprs, options) for triton.compile from one recorded launch: tensors become
    typed pointers, ints equal to 1 constexprs (as the JIT specialises them), other ints i32 (i64
    past its range), floats fp32."""
    import torch

    names = kernel.arg_names
    signature, constexprs = {}, {}
    options = {"num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages", 3)}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                constexprs[name] = 1
            else:
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} of type {type(value).__name__}")
    for name in names[len(args):]:
        constexprs[name] = kwargs[name]
    for name in constexprs:
        signature[name] = "constexpr"
    return {n: signature[n] for n in names}, constexprs, options


def _compile_all() -> int:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as exc:  # an older or newer triton without these entry points
        print(f"cannot compile ahead of time with this triton: {exc!r}")
        return 77
    from torch._subclasses.fake_tensor import FakeTensorMode

    from h2ochat_kernels import triton_chunk, triton_decode, triton_evict

    launches: list = []
    triton_decode._sm_count = lambda device: 132  # an H100 / H200: the launch plan's split count
    # the launched kernels (not the @triton.jit helpers they call) are recorded, then put back: a
    # kernel's compile hashes the globals it calls
    kernels = {(module, name): getattr(module, name) for module in (triton_decode, triton_chunk, triton_evict)
               for name in dir(module) if name.endswith("_kernel")}
    for module in (triton_decode, triton_chunk, triton_evict):
        module.launch_guard = lambda tensor: contextlib.nullcontext()  # no device to make current
    for (module, name), kernel in kernels.items():
        setattr(module, name, Recorder(kernel, launches))

    variants = {}
    with FakeTensorMode(allow_non_fake_inputs=False):
        for label, call in launch_scenarios():
            launches.clear()
            call()
            for kernel, args, kwargs in launches:
                signature, constexprs, options = signature_of(kernel, args, kwargs)
                key = json.dumps([kernel.__name__, signature, constexprs, options], sort_keys=True, default=str)
                variants.setdefault(key, (kernel, signature, constexprs, options, label))
    for (module, name), kernel in kernels.items():
        setattr(module, name, kernel)
    if not variants:
        print("no kernel launch was recorded")
        return 1

    target = GPUTarget("cuda", 90, 32)
    for kernel, signature, constexprs, options, label in variants.values():
        names = kernel.arg_names
        src = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
        compiled = triton.compile(src, target=target, options=options)
        shown = {k: v for k, v in constexprs.items() if not k.startswith("s") and k != "MASKED_LOGIT"}
        print("variant " + json.dumps(dict(kernel=kernel.__name__, first_from=label, shared=compiled.metadata.shared,
                                           constexprs=shown, signature={k: v for k, v in signature.items()
                                                                        if v.startswith("*")}, options=options)))
    print(f"{len(variants)} kernel variants compiled for sm_90")
    return 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(_compile_all())
