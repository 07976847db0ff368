"""Reading prompts and turning them into token ids."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from .errors import UserError


def read_prompt(prompt: str | None, prompt_file: Path | None = None) -> str:
    """The prompt text from the argument, '-' (standard input) or a file; refuses an empty one."""
    if prompt_file is not None:
        text = Path(prompt_file).read_text(encoding="utf-8")
    elif prompt == "-":
        text = sys.stdin.read()
    elif prompt is None:
        raise UserError("no prompt given (pass text, '-' for standard input, or --prompt-file)")
    else:
        text = prompt
    if not text.strip():
        raise UserError("the prompt is empty")
    return text


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer, text: str, chat: bool | None = None, system: str | None = None) -> torch.Tensor:
    """Token ids [1, T]: through the chat template when ``chat`` (None: when the tokenizer has one)."""
    if chat is None:
        chat = has_chat_template(tokenizer)
    if chat:
        if not has_chat_template(tokenizer):
            raise UserError("this model's tokenizer has no chat template; use --raw")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return torch.tensor([list(ids)], dtype=torch.long)
    return tokenizer(text, return_tensors="pt").input_ids
