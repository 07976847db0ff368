"""Tiny random checkpoints on disk (model + tokenizer + chat template) for CLI-level tests."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from conftest import build_model

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<|end|>"]


def _tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog " * 4, "once upon a time there was a dragon " * 4]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def write_checkpoint(folder: Path, family: str = "llama", **config_overrides) -> Path:
    """Save a tiny random ``family`` model with a byte-level BPE tokenizer into ``folder``."""
    tokenizer = _tokenizer(vocab_size=300)
    overrides = {"vocab_size": len(tokenizer), "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    overrides.update(config_overrides)
    model = build_model(family, attn="sdpa", **overrides)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load_tiny(tmp_path_factory, family: str, name: str, **config_overrides):
    """A tiny random checkpoint of ``family`` written under a fresh folder ``name-family`` and loaded on
    the CPU (the weights drawn from a fresh seed, named when a test fails)."""
    from seeds import fresh

    from h2ochat.loading.models import load

    fresh("model")
    folder = write_checkpoint(tmp_path_factory.mktemp(f"{name}-{family}"), family, **config_overrides)
    return load(str(folder), device="cpu", dtype="float32")


@contextlib.contextmanager
def writing(model, tokenizer, text: str = " the"):
    """Within the block, ``model`` writes the tokens of ``text`` over and over, whatever its random
    weights would: a forward hook on the output head lifts that token's logit far above the rest. A
    test about what happens once text is written (streamed pieces, a stop mid-reply) then does not
    depend on a random model happening to write bytes that make text, or to end its turn early."""
    token = tokenizer.encode(text, add_special_tokens=False)[0]

    def lift(_module, _inputs, logits):
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        bias[token] = 1e4
        return logits + bias

    handle = model.get_output_embeddings().register_forward_hook(lift)
    try:
        yield token
    finally:
        handle.remove()
