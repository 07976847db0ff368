"""The Hugging Face hub: a repository's metadata (its file list, its parameter count) fetched once
before downloading, which weight files to fetch, and the download itself.

Its own module because it is the only part of loading that talks to the network.
"""

from __future__ import annotations

from pathlib import Path

from .sources import ModelError


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


def download(repo: str, info=None) -> Path:
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
