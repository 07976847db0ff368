"""GGUF files de-quantized once and kept: where the converted copy lives, the note a first load
prints, and the partial folders a conversion writes (renamed when complete, removed when stale).

Its own module because the conversion's bookkeeping (a half-written folder is hundreds of MB, and a
killed process leaves one behind) is a concern of its own, apart from finding and loading a model.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from .cache_dirs import cache_root
from .sources import ModelError, resolve


def converted_gguf_dir(path: Path, dtype: torch.dtype) -> Path:
    """Where the de-quantized copy of a GGUF file is kept: converting Q4 tensors in Python takes
    tens of seconds, loading the saved result takes about one. Keyed by the file's content (its size
    and a hash of its first and last MiB: the header, with the metadata and the tokenizer, and the
    last tensors), not its modification time: a fresh install of the same file finds its copy."""
    return cache_root() / "gguf" / f"{path.stem}-{path.stat().st_size}-{content_key(path)}-{str(dtype).removeprefix('torch.')}"


KEY_BYTES = 1 << 20  # read from each end of the file for its key


def content_key(path: Path) -> str:
    """16 hex digits of a SHA-256 over the file's first and last ``KEY_BYTES``."""
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as file:
        digest.update(file.read(KEY_BYTES))
        size = path.stat().st_size
        if size > KEY_BYTES:
            file.seek(max(size - KEY_BYTES, KEY_BYTES))
            digest.update(file.read(KEY_BYTES))
    return digest.hexdigest()[:16]


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


def keep_converted(model, tokenizer, target: Path) -> str | None:
    """Save a converted GGUF model for next time; a failure only costs speed next time, and is
    returned in words (None when saved) for the caller to say once: without the copy, every run
    converts again.

    Written to a partial folder renamed when complete, so a reader never sees half a model; the
    partial folder is removed on any failure and on Ctrl-C (which then goes on interrupting).
    The weights are plain de-quantized tensors by now; transformers still marks the model as
    "quantized with gguf" and refuses to save it, so the mark is lifted for the save."""
    partial = target.with_name(f"{target.name}{PARTIAL}{os.getpid()}")
    quantizer, quant_config = getattr(model, "hf_quantizer", None), getattr(model.config, "quantization_config", None)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)  # (h2ochat's own cache folder)
        model.hf_quantizer = None
        if quant_config is not None:
            del model.config.quantization_config
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(target)
        return None
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: nothing left behind, still raised
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        return (f"could not keep the converted model in {target.parent} ({reason}): every run converts the GGUF "
                "file again; set H2OCHAT_CACHE_DIR to a writable folder")
    finally:
        model.hf_quantizer = quantizer
        if quant_config is not None:
            model.config.quantization_config = quant_config


@contextmanager
def quiet_gguf_advice():
    """transformers advises ``dtype=torch.float32`` when a GGUF file is loaded in another dtype, for
    its packed kernels; h2ochat de-quantizes the file once and keeps the copy, so the advice does not
    apply (and a CLI user could not follow it in those words)."""
    import logging

    quantizer_log = logging.getLogger("transformers.quantizers.quantizer_gguf")
    level = quantizer_log.level
    quantizer_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        quantizer_log.setLevel(level)
