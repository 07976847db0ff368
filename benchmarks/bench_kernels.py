"""Benchmark the H2O attention kernels: JSON to stdout, optionally a Markdown table to stderr/file.

On CUDA (Triton importable):
  decode attention + scoring at batch 1..64, 8 KV heads, 32 query heads, head_dim 128, 512..16384
  slots (fp16 by default). Per size: median time (CUDA events, L2 flushed before every timed call),
  achieved bandwidth = bytes that must move / time, as a fraction of the device's copy bandwidth
  measured in the same run (a large device-to-device copy, read + write bytes), the same kernel
  with scoring disabled (the SCORE constexpr: shows the bookkeeping cost), torch SDPA over the same
  cache plus a separate score computation (matmul + softmax + sum over the group), and the torch
  reference (``reference.attend_with_scores``, what the app runs without Triton). Also the eviction:
  the fused policy kernel (``evict_by_policy``: priority from score, token index, recent window and
  sinks, argmin and in-place write in one launch) vs the torch path (``slot_rank`` + ``keep_priority``
  + ``evict_and_insert``, what the app runs without Triton) and vs a torch priority + the Triton
  ``evict_and_insert`` kernel (two steps), and the fused kernel called through its custom op
  (``torch.ops.h2ochat.evict_by_policy``: what a compiled step calls where no CUDA graph replays it,
  so the op's dispatch cost shows); and a prefill chunk vs the torch reference. Beside every decode
  size, the same slots as int8 and int4 codes (``--kv-dtype``: ``h2ochat_kernels.quant``), the
  quantised decode kernel timed next to the unquantised one timed again: time, bytes read per step
  (codes + float32 scale and offset per slot, index, scores), bandwidth, and both ratios
  ("decode_quant"; the check: time ratio within 1.15x of the bytes ratio at batch 16 / 4096 slots).
  Every Triton result is first checked against the torch reference at that size ("max_err").

On the CPU: only the torch paths run (the Triton interpreter is ~1000x slower and says nothing about
GPU speed), at small sizes, the eviction as the torch policy path and the torch given-priority
eviction, and the torch reference over int8 / int4 slots beside the unquantised one (the CPU's
eager dequantise-in-the-step cost); the JSON says so ("backend": "torch", "note").

    python benchmarks/bench_kernels.py [--quick] [--markdown [PATH]] [--dtype fp16|bf16|fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from h2ochat_kernels import quant, reference  # (importing the package registers the torch.ops.h2ochat ops)

KV_HEADS, Q_HEADS, HEAD_DIM = 8, 32, 128
GROUP = Q_HEADS // KV_HEADS
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
TARGETS = {
    "bandwidth_fraction_at_b16_s4096": 0.70,
    "max_scoring_overhead": 0.10,
    "faster_than_sdpa_plus_scores": True,
    "quant_time_over_bytes_ratio": 1.15,  # int8 / int4 decode: time ratio <= 1.15 x bytes ratio (b16 s4096)
}


# ---------------------------------------------------------------------------------------- timing
class CudaTimer:
    def __init__(self, device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup
        # larger than any L2 (H200: 60 MiB): every timed call starts from a cold cache, as each
        # layer's cache would in a real decode step
        self.flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)

    def __call__(self, fn) -> float:
        """Median seconds of one call."""
        for _ in range(self.warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for s, e in zip(starts, ends):
            self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


class CpuTimer:
    def __init__(self, reps: int, warmup: int):
        self.reps, self.warmup = reps, warmup

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def copy_bandwidth(device, timer, nbytes: int) -> float:
    """Bytes/s of a device-to-device (or host memcpy) copy: read + write bytes per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    return 2 * nbytes / t


# ---------------------------------------------------------------------------------------- inputs
def decode_inputs(batch, slots, dtype, device, group=GROUP, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    g = torch.Generator(device=device).manual_seed(batch * 100003 + slots)

    def randn(*shape):  # drawn on the device: the largest sizes hold ~10^9 elements
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    return dict(
        query=randn(batch, kv_heads, group, 1, head_dim),
        cache_keys=randn(batch, kv_heads, slots, head_dim),
        cache_values=randn(batch, kv_heads, slots, head_dim),
        slot_token_index=torch.arange(slots, device=device).repeat(batch, kv_heads, 1),
        new_keys=randn(batch, kv_heads, 1, head_dim),
        new_values=randn(batch, kv_heads, 1, head_dim),
        new_valid=None,
        scale=head_dim ** -0.5,
        scores=torch.zeros(batch, kv_heads, slots, device=device),
    )


def sdpa_plus_scores(inp):
    """torch SDPA over the cache + the new token, and scores from a separate matmul+softmax+sum.

    The cache is passed with the new token already in place (a buffer of S + 1 slots, copied before
    timing), every slot valid, no mask: SDPA's best case.
    """
    q = inp["query"]
    batch, kv_heads, group, _, head_dim = q.shape
    k_full = torch.cat([inp["cache_keys"], inp["new_keys"]], dim=2)
    v_full = torch.cat([inp["cache_values"], inp["new_values"]], dim=2)
    q_heads = q.reshape(batch, kv_heads * group, 1, head_dim)
    q_grouped = q.reshape(batch, kv_heads, group, head_dim)
    scores, scale, slots = inp["scores"], inp["scale"], inp["cache_keys"].shape[2]

    def run():
        out = F.scaled_dot_product_attention(q_heads, k_full, v_full, scale=scale, enable_gqa=True)
        logits = torch.matmul(q_grouped, k_full.transpose(-1, -2)).float() * scale
        probs = logits.softmax(dim=-1).sum(dim=2)
        scores.add_(probs[..., :slots])
        return out, probs[..., slots:]

    return run


def decode_bytes(batch, slots, dtype, score: bool, group=GROUP, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                 bits: int | None = None) -> int:
    """Bytes that must move: K and V read (with ``bits``: their codes, scales and offsets,
    ``quant.bytes_per_token`` each), slot index read; when scoring, scores read + written."""
    n = batch * kv_heads * slots
    element = torch.finfo(dtype).bits // 8
    per_slot = 2 * (head_dim * element if bits is None else quant.bytes_per_token(head_dim, bits))
    total = n * per_slot + n * 8
    if score:
        total += 2 * n * 4
    return total


QUANT_BITS = (8, 4)


def quantised(inp, bits):
    """``inp`` with its slots as ``bits``-bit codes (the same keys and values): (inputs, QuantSlots)."""
    key_codes, key_scale, key_offset = quant.quantize(inp["cache_keys"], bits)
    value_codes, value_scale, value_offset = quant.quantize(inp["cache_values"], bits)
    head_dim = inp["cache_keys"].shape[-1]
    slots_q = quant.QuantSlots(bits, key_scale, key_offset, value_scale, value_offset, head_dim, head_dim)
    return {**inp, "cache_keys": key_codes, "cache_values": value_codes}, slots_q


def quant_rows(inp, dtype, timer, attend, t_plain: float, copy_bw: float, check=None) -> list[dict]:
    """The decode step over the same slots as int8 and int4 codes, next to the unquantised one
    (``t_plain`` seconds, timed by the caller in the same run): time, bytes read, bandwidth, and the
    ratios of both against the unquantised step. ``attend(inputs, quant)`` runs one step;
    ``check(inputs, quant)`` (optional) gives its error against the torch reference."""
    batch, kv_heads, slots, head_dim = inp["cache_keys"].shape
    shape = dict(kv_heads=kv_heads, head_dim=head_dim)
    plain_bytes = decode_bytes(batch, slots, dtype, True, **shape)
    rows = []
    for bits in QUANT_BITS:
        q_inp, slots_q = quantised(inp, bits)
        row = dict(batch=batch, slots=slots, kv_dtype=f"int{bits}")
        if check is not None:
            row["max_err"] = check(q_inp, slots_q)
        t = timer(lambda: attend(q_inp, slots_q))
        nbytes = decode_bytes(batch, slots, dtype, True, bits=bits, **shape)
        row.update(t_us=t * 1e6, t_unquantised_us=t_plain * 1e6, time_ratio=t / t_plain, bytes=nbytes,
                   bytes_ratio=nbytes / plain_bytes, bw_GBps=nbytes / t / 1e9, bw_fraction_of_copy=nbytes / t / copy_bw)
        rows.append(row)
    return rows


EVICT_POLICY = dict(recent=64, sinks=4)  # H2O: score rank, a recent window and attention sinks


def evict_inputs(batch, slots, dtype, device):
    """A full cache (every slot a distinct earlier token) and the token to insert, for the eviction."""
    g = torch.Generator(device=device).manual_seed(batch * 7 + slots)
    state = [
        torch.randn(batch, KV_HEADS, slots, HEAD_DIM, device=device, generator=g).to(dtype),
        torch.randn(batch, KV_HEADS, slots, HEAD_DIM, device=device, generator=g).to(dtype),
        torch.rand(batch, KV_HEADS, slots, device=device, generator=g),
        torch.arange(slots, device=device).repeat(batch, KV_HEADS, 1),
        torch.arange(slots, device=device).repeat(batch, KV_HEADS, 1),
    ]
    new = [
        torch.randn(batch, KV_HEADS, 1, HEAD_DIM, device=device, generator=g).to(dtype),
        torch.randn(batch, KV_HEADS, 1, HEAD_DIM, device=device, generator=g).to(dtype),
        torch.rand(batch, KV_HEADS, device=device, generator=g),
        torch.full((batch,), slots, device=device, dtype=torch.int64),
        torch.full((batch,), slots, device=device, dtype=torch.int64),
    ]
    return state, new


def torch_priority(state, new, policy=EVICT_POLICY):
    """The priority the torch path computes before its eviction (reference.evict_by_policy's first half)."""
    rank = reference.slot_rank(state[2], state[3], new[3])
    return reference.keep_priority(rank, state[3], new[3], policy["recent"], policy["sinks"])


def same_results(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------- runs
def bench_cuda(args, dtype):
    device = torch.device("cuda")
    timer = CudaTimer(device, reps=args.reps, warmup=3)
    sizes = dict(
        batches=[1, 16] if args.quick else [1, 4, 16, 64],
        slot_counts=[512, 4096] if args.quick else [512, 2048, 4096, 8192, 16384],
        evict_slots=4096,
        chunk_cases=[(1, 256, 2048)] if args.quick else [(1, 512, 4096), (4, 256, 2048)],
    )
    result = bench_triton(dtype, device, timer, copy_bytes=1 << 30, **sizes)
    return dict(result, device=torch.cuda.get_device_name(device))


def bench_triton(dtype, device, timer, *, copy_bytes, batches, slot_counts, evict_slots, chunk_cases):
    """Triton vs torch at the given sizes (on CUDA; also runs under TRITON_INTERPRET=1 as a smoke test)."""
    from h2ochat_kernels.triton_chunk import chunk_attend_with_scores
    from h2ochat_kernels.triton_decode import decode_attend_with_scores
    from h2ochat_kernels.triton_evict import evict_and_insert as triton_evict
    from h2ochat_kernels.triton_evict import evict_by_policy as triton_evict_by_policy

    copy_bw = copy_bandwidth(device, timer, copy_bytes)

    def triton_quant_error(q_inp, slots_q):
        ref_scores = q_inp["scores"].clone()
        want, want_new = reference.attend_with_scores(**{**q_inp, "scores": ref_scores}, quant=slots_q)
        got, got_new = decode_attend_with_scores(**{**q_inp, "scores": q_inp["scores"].clone()}, quant=slots_q)
        return max(max_rel_err(got, want), max_rel_err(got_new, want_new))

    rows, quant_decode = [], []
    for batch in batches:
        for slots in slot_counts:
            inp = decode_inputs(batch, slots, dtype, device)
            # correctness at this size first
            ref_scores = inp["scores"].clone()
            want, want_new = reference.attend_with_scores(**{**inp, "scores": ref_scores})
            got, got_new = decode_attend_with_scores(**inp)
            err = max(max_rel_err(got, want), max_rel_err(inp["scores"], ref_scores), max_rel_err(got_new, want_new))

            t_score = timer(lambda: decode_attend_with_scores(**inp))
            t_plain = timer(lambda: decode_attend_with_scores(**inp, score=False))
            t_sdpa = timer(sdpa_plus_scores(inp))
            t_ref = timer(lambda: reference.attend_with_scores(**inp))
            bytes_score = decode_bytes(batch, slots, dtype, True)
            bytes_plain = decode_bytes(batch, slots, dtype, False)
            rows.append(dict(
                batch=batch, slots=slots, max_err=err,
                t_triton_us=t_score * 1e6, t_triton_noscore_us=t_plain * 1e6,
                t_sdpa_plus_scores_us=t_sdpa * 1e6, t_torch_reference_us=t_ref * 1e6,
                bytes=bytes_score, bw_GBps=bytes_score / t_score / 1e9,
                bw_fraction_of_copy=bytes_score / t_score / copy_bw,
                bw_fraction_noscore=bytes_plain / t_plain / copy_bw,
                scoring_overhead=t_score / t_plain - 1.0,
                speedup_vs_sdpa_plus_scores=t_sdpa / t_score,
                speedup_vs_torch_reference=t_ref / t_score,
            ))
            del want, got
            print(f"decode B={batch} S={slots}: {rows[-1]['t_triton_us']:.1f} us, "
                  f"{rows[-1]['bw_fraction_of_copy']:.0%} of copy bw", file=sys.stderr)
            # the same slots quantised, the unquantised step timed again beside them (one noise regime)
            t_again = timer(lambda: decode_attend_with_scores(**inp))
            quant_decode += quant_rows(inp, dtype, timer, lambda q, s: decode_attend_with_scores(**q, quant=s),
                                       t_again, copy_bw, check=triton_quant_error)
            for r in quant_decode[-len(QUANT_BITS):]:
                print(f"  {r['kv_dtype']}: {r['t_us']:.1f} us ({r['time_ratio']:.2f}x time, {r['bytes_ratio']:.2f}x "
                      f"bytes), {r['bw_fraction_of_copy']:.0%} of copy bw", file=sys.stderr)
            del inp

    evict_rows = []
    for batch in batches:
        slots = evict_slots
        state, new = evict_inputs(batch, slots, dtype, device)
        fused, ref, two_step = ([t.clone() for t in state] for _ in range(3))
        got = triton_evict_by_policy(*fused, *new, **EVICT_POLICY)
        want = reference.evict_by_policy(*ref, *new, **EVICT_POLICY)
        two = triton_evict(torch_priority(two_step, new), *two_step, *new)
        same = same_results(got, want) and same_results(fused, ref) and same_results(two, want)
        same = same and same_results(two_step, ref)
        t_fused = timer(lambda: triton_evict_by_policy(*fused, *new, **EVICT_POLICY))
        t_torch = timer(lambda: reference.evict_by_policy(*ref, *new, **EVICT_POLICY))
        t_two = timer(lambda: triton_evict(torch_priority(two_step, new), *two_step, *new))
        # the same launch through its custom op (what a compiled graph calls when no CUDA graph replays it)
        op_args = (*fused, *new, None, None, EVICT_POLICY["recent"], None, EVICT_POLICY["sinks"], None, False, False,
                   None)
        t_op = timer(lambda: torch.ops.h2ochat.evict_by_policy(*op_args))
        evict_rows.append(dict(batch=batch, slots=slots, policy="h2o", matches_reference=same,
                               t_fused_us=t_fused * 1e6, t_fused_op_us=t_op * 1e6, t_torch_us=t_torch * 1e6,
                               t_torch_priority_triton_evict_us=t_two * 1e6, speedup=t_torch / t_fused))

    chunk_rows = []
    for batch, q_len, slots in chunk_cases:
        g = torch.Generator(device=device).manual_seed(q_len)

        def randn(*shape):
            return torch.randn(*shape, generator=g, device=device).to(dtype)

        inp = dict(
            query=randn(batch, KV_HEADS, GROUP, q_len, HEAD_DIM),
            cache_keys=randn(batch, KV_HEADS, slots, HEAD_DIM), cache_values=randn(batch, KV_HEADS, slots, HEAD_DIM),
            slot_token_index=torch.arange(slots, device=device).repeat(batch, KV_HEADS, 1),
            new_keys=randn(batch, KV_HEADS, q_len, HEAD_DIM), new_values=randn(batch, KV_HEADS, q_len, HEAD_DIM),
            new_valid=None, scale=HEAD_DIM ** -0.5, scores=torch.zeros(batch, KV_HEADS, slots, device=device),
        )
        ref_scores = inp["scores"].clone()
        want, want_new = reference.attend_with_scores(**{**inp, "scores": ref_scores})
        got, got_new = chunk_attend_with_scores(**inp)
        err = max(max_rel_err(got, want), max_rel_err(inp["scores"], ref_scores), max_rel_err(got_new, want_new))
        t_tri = timer(lambda: chunk_attend_with_scores(**inp))
        t_ref = timer(lambda: reference.attend_with_scores(**inp))
        flops = 4 * batch * Q_HEADS * q_len * (slots + q_len / 2) * HEAD_DIM * 1.5  # QK twice, PV once
        chunk_rows.append(dict(batch=batch, q_len=q_len, slots=slots, max_err=err, t_triton_us=t_tri * 1e6,
                               t_torch_reference_us=t_ref * 1e6, speedup=t_ref / t_tri,
                               tflops=flops / t_tri / 1e12))

    return dict(
        backend="triton", device=str(device), copy_bandwidth_GBps=copy_bw / 1e9,
        decode=rows, decode_quant=quant_decode, evict=evict_rows, chunk=chunk_rows,
        checks=check_targets(rows, quant_decode),
    )


def check_targets(rows, quant_decode=()):
    at = [r for r in rows if r["batch"] == 16 and r["slots"] == 4096]
    quant_at = {r["kv_dtype"]: r for r in quant_decode if r["batch"] == 16 and r["slots"] == 4096}
    # "fewer bytes read per step in proportion": the quantised step's time ratio within 15% of its bytes ratio
    in_proportion = {f"{name}_time_over_bytes_ratio_at_b16_s4096": r["time_ratio"] / r["bytes_ratio"]
                     for name, r in quant_at.items()}
    return dict(
        **in_proportion,
        quant_time_in_proportion_to_bytes=(all(v <= TARGETS["quant_time_over_bytes_ratio"]
                                               for v in in_proportion.values()) if in_proportion else None),
        quant_results_match_reference=all(r["max_err"] < 2e-2 for r in quant_decode) if quant_decode else None,
        bandwidth_fraction_at_b16_s4096=(at[0]["bw_fraction_of_copy"] if at else None),
        bandwidth_target_met=(at[0]["bw_fraction_of_copy"] >= TARGETS["bandwidth_fraction_at_b16_s4096"] if at else None),
        max_scoring_overhead=max(r["scoring_overhead"] for r in rows),
        scoring_overhead_target_met=all(r["scoring_overhead"] <= TARGETS["max_scoring_overhead"] for r in rows),
        min_speedup_vs_sdpa_plus_scores=min(r["speedup_vs_sdpa_plus_scores"] for r in rows),
        faster_than_sdpa_everywhere=all(r["speedup_vs_sdpa_plus_scores"] > 1.0 for r in rows),
        all_results_match_reference=all(r["max_err"] < 2e-2 for r in rows),
    )


# one SmolLM2-135M layer (3 KV heads, 3 query heads each, head_dim 64): the CPU's own decode regime,
# where a step is many small ops and each extra op costs more than the bytes it saves
MODEL_LAYER = dict(kv_heads=3, group=3, head_dim=64)


def model_layer_quant_rows(dtype, copy_bw: float, reps: int) -> list[dict]:
    """The torch reference's decode attention of one SmolLM2-sized layer over int8 / int4 slots beside
    the unquantised one, and the write side: quantising the step's new key and value
    (``t_quantize_new_token_us``, keys and values together, per layer)."""
    timer = CpuTimer(reps=reps, warmup=20)
    rows = []
    for batch in (1, 4):
        for slots in (128, 256):
            inp = decode_inputs(batch, slots, dtype, "cpu", **MODEL_LAYER)
            t_plain = timer(lambda: reference.attend_with_scores(**inp))
            layer = quant_rows(inp, dtype, timer, lambda q, s: reference.attend_with_scores(**q, quant=s), t_plain,
                               copy_bw)
            for row in layer:
                bits = int(row["kv_dtype"][3:])
                row["t_quantize_new_token_us"] = timer(lambda: (quant.quantize(inp["new_keys"], bits),
                                                                quant.quantize(inp["new_values"], bits))) * 1e6
            rows += layer
    return rows


def bench_cpu(args, dtype):
    torch.set_num_threads(max(1, torch.get_num_threads()))
    timer = CpuTimer(reps=args.reps, warmup=1)
    copy_bw = copy_bandwidth(torch.device("cpu"), timer, 256 << 20)
    batches = [1, 4] if args.quick else [1, 4, 16]
    slot_counts = [512, 2048] if args.quick else [512, 2048, 4096]
    rows, quant_decode = [], []
    for batch in batches:
        for slots in slot_counts:
            inp = decode_inputs(batch, slots, dtype, "cpu")
            t_ref = timer(lambda: reference.attend_with_scores(**inp))
            t_sdpa = timer(sdpa_plus_scores(inp))
            nbytes = decode_bytes(batch, slots, dtype, True)
            rows.append(dict(batch=batch, slots=slots, t_torch_reference_us=t_ref * 1e6,
                             t_sdpa_plus_scores_us=t_sdpa * 1e6, bytes=nbytes,
                             bw_GBps=nbytes / t_ref / 1e9, bw_fraction_of_copy=nbytes / t_ref / copy_bw,
                             speedup_vs_sdpa_plus_scores=t_sdpa / t_ref))
            # the torch reference over the same slots quantised (dequantised inside the step), the
            # unquantised reference timed again beside them
            t_again = timer(lambda: reference.attend_with_scores(**inp))
            quant_decode += quant_rows(inp, dtype, timer, lambda q, s: reference.attend_with_scores(**q, quant=s),
                                       t_again, copy_bw)
    evict_rows = []
    for batch in batches:
        slots = 2048
        state, new = evict_inputs(batch, slots, dtype, "cpu")
        t_policy = timer(lambda: reference.evict_by_policy(*state, *new, **EVICT_POLICY))
        priority = torch_priority(state, new)
        t_given = timer(lambda: reference.evict_and_insert(priority, *state, *new))
        evict_rows.append(dict(batch=batch, slots=slots, policy="h2o", t_torch_us=t_policy * 1e6,
                               t_torch_given_priority_us=t_given * 1e6))
    return dict(
        backend="torch", device="cpu", copy_bandwidth_GBps=copy_bw / 1e9, decode=rows, decode_quant=quant_decode,
        decode_quant_model_layer=model_layer_quant_rows(dtype, copy_bw, reps=max(args.reps, 30) * 10),
        evict=evict_rows,
        note="no CUDA device: only the torch reference and SDPA+scores were timed, at small sizes, with "
             "perf_counter medians; the Triton kernels are not timed on the CPU (the interpreter is "
             "~1000x slower and says nothing about GPU speed). GPU targets cannot be checked here.",
    )


def quant_markdown(result, what: str) -> list[str]:
    rows = result.get("decode_quant") or []
    if not rows:
        return []
    lines = ["", f"| quantised decode ({what}) batch | slots | kv | us | unquantised us | time ratio | bytes ratio | "
                 f"% copy bw |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['slots']} | {r['kv_dtype']} | {r['t_us']:.1f} | {r['t_unquantised_us']:.1f} | "
                     f"{r['time_ratio']:.2f}x | {r['bytes_ratio']:.2f}x | {r['bw_fraction_of_copy']:.0%} |")
    return lines


def markdown(result) -> str:
    lines = [f"Device: {result['device']} ({result['backend']}), dtype {result['dtype']}, copy bandwidth "
             f"{result['copy_bandwidth_GBps']:.0f} GB/s", ""]
    if result["backend"] == "triton":
        lines += ["| batch | slots | triton us | no-score us | score cost | % copy bw | SDPA+scores us | vs SDPA | torch ref us | max err |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["decode"]:
            lines.append(f"| {r['batch']} | {r['slots']} | {r['t_triton_us']:.1f} | {r['t_triton_noscore_us']:.1f} | "
                         f"{r['scoring_overhead']:+.1%} | {r['bw_fraction_of_copy']:.0%} | {r['t_sdpa_plus_scores_us']:.1f} | "
                         f"{r['speedup_vs_sdpa_plus_scores']:.2f}x | {r['t_torch_reference_us']:.1f} | {r['max_err']:.1e} |")
        lines += ["", "| evict batch | slots | fused policy kernel us | the same as a custom op us | torch priority + "
                  "evict us | torch priority + triton evict us | speedup | matches |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in result["evict"]:
            lines.append(f"| {r['batch']} | {r['slots']} | {r['t_fused_us']:.1f} | {r['t_fused_op_us']:.1f} | "
                         f"{r['t_torch_us']:.1f} | "
                         f"{r['t_torch_priority_triton_evict_us']:.1f} | {r['speedup']:.2f}x | {r['matches_reference']} |")
        lines += ["", "| chunk batch | q_len | slots | triton us | torch ref us | speedup | TFLOP/s | max err |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["chunk"]:
            lines.append(f"| {r['batch']} | {r['q_len']} | {r['slots']} | {r['t_triton_us']:.1f} | "
                         f"{r['t_torch_reference_us']:.1f} | {r['speedup']:.2f}x | {r['tflops']:.1f} | {r['max_err']:.1e} |")
        lines += quant_markdown(result, "triton")
        lines += ["", "Checks: " + json.dumps(result["checks"])]
    else:
        lines += ["| batch | slots | torch ref us | % copy bw | SDPA+scores us | ref vs SDPA |", "|---:|---:|---:|---:|---:|---:|"]
        for r in result["decode"]:
            lines.append(f"| {r['batch']} | {r['slots']} | {r['t_torch_reference_us']:.1f} | {r['bw_fraction_of_copy']:.0%} | "
                         f"{r['t_sdpa_plus_scores_us']:.1f} | {r['speedup_vs_sdpa_plus_scores']:.2f}x |")
        lines += ["", "| evict batch | slots | torch priority + evict us | evict given a priority us |",
                  "|---:|---:|---:|---:|"]
        for r in result["evict"]:
            lines.append(f"| {r['batch']} | {r['slots']} | {r['t_torch_us']:.1f} | {r['t_torch_given_priority_us']:.1f} |")
        lines += quant_markdown(result, "torch reference")
        lines += ["", "| one SmolLM2 layer, batch | slots | kv | attention us | unquantised us | time ratio | "
                      "quantise the new K and V us |", "|---:|---:|---|---:|---:|---:|---:|"]
        for r in result.get("decode_quant_model_layer", []):
            lines.append(f"| {r['batch']} | {r['slots']} | {r['kv_dtype']} | {r['t_us']:.1f} | "
                         f"{r['t_unquantised_us']:.1f} | {r['time_ratio']:.2f}x | {r['t_quantize_new_token_us']:.1f} |")
        lines += ["", f"Note: {result['note']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--markdown", nargs="?", const="-", default=None, metavar="PATH",
                        help="also write a Markdown table (to PATH, or to stderr)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default fp16 on CUDA, fp32 on the CPU (what the app runs there)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 5 if args.quick else 30
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.dtype is None:
        args.dtype = "fp16" if use_cuda else "fp32"
    dtype = DTYPES[args.dtype]
    if use_cuda:
        os.environ.pop("TRITON_INTERPRET", None)
        result = bench_cuda(args, dtype)
    else:
        result = bench_cpu(args, dtype)
    result = {"dtype": args.dtype, "kv_heads": KV_HEADS, "q_heads": Q_HEADS, "head_dim": HEAD_DIM,
              "targets": TARGETS, "quick": args.quick, **result}
    from json_report import emit  # (here: tests import this file as a module without benchmarks/ on the path)

    emit(result, None)
    if args.markdown is not None:
        table = markdown(result)
        if args.markdown == "-":
            sys.stderr.write(table)
        else:
            with open(args.markdown, "w") as fh:
                fh.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
