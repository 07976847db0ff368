"""``--random-weights``: a model built from its shipped configuration (or a directory's config.json)
with random weights straight on the target device, and the byte-level tokenizer it runs with.

Decode cost does not depend on the weights' values, so speed can be measured offline, without a
download.
"""

from __future__ import annotations

import copy
from pathlib import Path

from .sources import ALIASES, ModelError, ModelSource, shipped_config, shipped_config_path


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


def build_random(config, dtype: torch.dtype, device: str | torch.device):
    """The model ``config`` describes with random weights, allocated on ``device`` in ``dtype`` as it is
    built: built on the CPU in fp32 and then moved, a 6.7B model would take 27 GB of host memory and
    minutes; this way it takes seconds on a GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..engine import attention

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
