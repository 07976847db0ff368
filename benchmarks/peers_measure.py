"""Measuring helpers for benchmarks/peers.py: the machine a run was on, the resident memory and CPU time of a
server's whole process tree, where py-spy's samples of h2ochat's engine fall, and SmolLM2's linear layers
timed in bf16 against fp32 on this CPU. Also a command: ``python benchmarks/peers_measure.py --profile FILE``
(a py-spy raw profile's summary) or ``--bf16-check`` (prints the timing JSON)."""

from __future__ import annotations

import platform
import sys
import threading
import time
from pathlib import Path

import psutil


def _dist_version(name: str) -> str | None:
    import importlib.metadata as metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    """What the figures were measured on: the CPU model, its cores and the bf16 instructions it has."""
    flags, model = set(), platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "logical_cpus": psutil.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
            "memory_bytes": psutil.virtual_memory().total,
            "bf16_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2"}),
            "python": platform.python_version(), "torch": _dist_version("torch")}


class TreeSampler:
    """Peak resident memory and CPU seconds of a process and all its children, sampled every interval."""

    def __init__(self, pid: int, interval: float = 0.5):
        self.root, self.interval = psutil.Process(pid), interval
        self.peak_rss, self.cpu_seconds = 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def sample(self) -> None:
        rss = 0
        for process in self._tree():
            try:
                rss += process.memory_info().rss
                times = process.cpu_times()
                self.cpu_seconds[process.pid] = times.user + times.system  # a process's last reading counts
            except psutil.NoSuchProcess:
                continue
        self.peak_rss = max(self.peak_rss, rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        self.sample()
        self._start_cpu = sum(self.cpu_seconds.values())
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()

    def load_cpu_seconds(self) -> float:
        return sum(self.cpu_seconds.values()) - self._start_cpu


# where a py-spy sample of h2ochat's engine is: the scheduler step it is in, and what its innermost frame does
PHASES = (("_prefill_step", "prefill"), ("_decode_step", "decode"))
LEAF_KINDS = (("nn/modules/linear.py", "linear layers"), ("kernels/", "H2O attention kernels"), ("/attention.py", "attention"), ("/kv/", "kv cache (H2O)"),
              ("/policies.py", "kv cache (H2O)"), ("/recall/", "recall"), ("sampling.py", "sampling"),
              ("/rotary.py", "rotary"), ("nn/modules/", "other torch modules"), ("transformers/", "transformers code"))


def summarize_profile(path: Path) -> dict:
    """Shares of py-spy's samples (raw collapsed stacks) by scheduler phase and by innermost frame's kind."""
    phases, leaves, total = {}, {}, 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        total += n
        phase = next((name for marker, name in PHASES if marker in stack), "other (server, tokenizer, waiting)")
        phases[phase] = phases.get(phase, 0) + n
        leaf = next((name for marker, name in LEAF_KINDS if marker in frames[-1]), "other python")
        leaves[f"{phase}: {leaf}"] = leaves.get(f"{phase}: {leaf}", 0) + n
    share = lambda counts: {k: round(v / max(total, 1), 3) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
    return {"samples": total, "by_phase": share(phases), "by_phase_and_leaf": share(leaves)}


# SmolLM2-135M's linear layers (in, out): q, k/v, o, gate/up, down, the tied head
SMOLLM2_LINEARS = {"q_proj": (576, 576), "kv_proj": (576, 192), "o_proj": (576, 576), "gate_up": (576, 1536),
                   "down": (1536, 576), "lm_head": (576, 49152)}


def bf16_matmul_check(rows: tuple[int, ...] = (1, 8, 300), flops_per_shape: float = 4e8) -> dict:
    """CPU seconds of one thread for each linear at the model's shapes in bfloat16 and float32, side by side
    (interleaved, so both see the same machine load): does this CPU's bf16 path beat fp32?"""
    import torch
    torch.set_num_threads(1)
    out = {}
    for n in rows:
        for name, (fan_in, fan_out) in SMOLLM2_LINEARS.items():
            times, repeats = {}, max(3, int(flops_per_shape / (2 * n * fan_in * fan_out)))
            for dtype in (torch.float32, torch.bfloat16) * 2:  # warm both, then the measured pass
                x, w = torch.randn(n, fan_in, dtype=dtype), torch.randn(fan_out, fan_in, dtype=dtype)
                start = time.process_time()
                for _ in range(repeats):
                    torch.nn.functional.linear(x, w)
                times[str(dtype).removeprefix("torch.")] = (time.process_time() - start) / repeats
            out[f"{name}[{n}x{fan_in}->{fan_out}]"] = {**{k: round(v * 1e6, 1) for k, v in times.items()},
                                                      "fp32_over_bf16": round(times["float32"] / times["bfloat16"], 2)}
    return {"unit": "CPU microseconds per call, one thread", "torch": torch.__version__,
            "mkldnn_bf16_supported": bool(getattr(torch.backends.mkldnn, "is_available", lambda: False)()), "shapes": out}


if __name__ == "__main__":
    from json_report import emit  # (here: peers.py imports this file as a module)

    if sys.argv[1:2] == ["--profile"]:
        emit(summarize_profile(Path(sys.argv[2])), None)
    elif sys.argv[1:2] == ["--bf16-check"]:
        emit({"machine": machine(), "bf16_matmul": bf16_matmul_check()}, None)
    else:
        sys.exit("usage: peers_measure.py --profile PYSPY_RAW_FILE | --bf16-check")
