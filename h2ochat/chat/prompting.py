"""Reading prompts and turning them into token ids."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UserError


def decode_text(data: bytes, where: str) -> str:
    """``data`` as UTF-8, or a UserError naming ``where`` and the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{where} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
                        f"({exc.reason}); convert it first, e.g. iconv -f latin1 -t utf-8") from None


def typed_text(text: str, where: str) -> str:
    """``text`` as typed on the command line, if it is UTF-8: Python decodes arguments with
    ``surrogateescape``, so a stray byte arrives as a lone surrogate that the tokenizer would fail on
    after the model loads (a UserError naming ``where`` and the byte instead)."""
    try:
        data = text.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError as exc:  # a surrogate no byte stands for (U+D800 typed as such)
        raise UserError(f"{where} is not valid Unicode text: a lone surrogate U+{ord(text[exc.start]):04X} "
                        f"at character {exc.start}") from None
    return decode_text(data, where)


def read_text_file(path: Path | str) -> str:
    """A text file the user named, as UTF-8 (a UserError naming the file otherwise)."""
    return decode_text(Path(path).read_bytes(), str(path))


def read_stdin() -> str:
    """Standard input as UTF-8. Read as bytes: Python decodes stdin with ``surrogateescape``, so a
    stray byte would reach the tokenizer as a lone surrogate and fail there, after the model loads."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is not None:
        return decode_text(stream.read(), "standard input")
    text = sys.stdin.read()  # already text (a test's StringIO): refuse what surrogateescape let in
    return decode_text(text.encode("utf-8", errors="surrogateescape"), "standard input")


def read_prompt(prompt: str | None, prompt_file: Path | None = None) -> str:
    """The prompt text from the argument, '-' (standard input) or a file; refuses an empty one, and
    both a prompt and --prompt-file (one of them would be ignored)."""
    if prompt is not None and prompt_file is not None:
        raise UserError("give the prompt as text (or '-' for standard input) or --prompt-file, not both")
    if prompt_file is not None:
        text = read_text_file(prompt_file)
    elif prompt == "-":
        text = read_stdin()
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
    import torch

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
