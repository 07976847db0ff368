"""From checked request parameters to the engine's ``Prepared``: the prompt rendered, tokenized the
way the chat REPL does, and held against the server's limits (errors in the OpenAI shape)."""

from __future__ import annotations

from ..engine.generation import Sampling
from ..chat.prompting import has_chat_template
from .api import RequestParams
from .errors import context_length_exceeded, invalid
from .parked import ParkedStore
from .sequence import Prepared


class Preparer:
    """``prepare(params)`` for one model: thread-safe (handlers call it from worker threads).

    ``bounded``: whether a conversation must stay within ``max_context`` tokens (the model's
    positions under ``--positions absolute`` or a budget of the whole window; the full policy's
    slots); with compact positions and an evicting cache it has no length limit, only
    ``max_tokens_cap`` per request.
    """

    def __init__(self, tokenizer, store: ParkedStore, *, vocab_size: int, max_context: int, bounded: bool,
                 max_tokens_cap: int, repetition_penalty: float = 1.0, repeat_last_n: int = 64,
                 max_prompt_tokens: int | None = None):
        self.tokenizer, self.store = tokenizer, store
        self.vocab_size, self.max_context, self.bounded = vocab_size, max_context, bounded
        self.max_tokens_cap = max_tokens_cap
        self.repetition_penalty, self.repeat_last_n = repetition_penalty, repeat_last_n
        self.max_prompt_tokens = max_prompt_tokens  # None or 0: no limit (--max-prompt-tokens)

    def encode(self, text: str, special: bool) -> list[int]:
        if not text:
            return []
        if not hasattr(self.tokenizer, "apply_chat_template"):  # --random-weights' byte tokenizer: no specials
            return list(self.tokenizer.encode(text))
        return list(self.tokenizer(text, add_special_tokens=special).input_ids)

    def prompt(self, params: RequestParams) -> tuple[list[int], str | None]:
        """The request's tokens and the text they spell. A conversation the server has parked is
        extended as the REPL extends its own: its tokens, then the tokens of the text past it."""
        if params.kind == "chat":
            if not has_chat_template(self.tokenizer):
                raise invalid("this model has no chat template: use /v1/completions", param="messages")
            text = self.tokenizer.apply_chat_template(params.messages, add_generation_prompt=True, tokenize=False)
            special = False  # the rendered template carries its own special tokens
        elif isinstance(params.prompt, list):
            if max(params.prompt) >= self.vocab_size:
                raise invalid(f"prompt token ids must be below the vocabulary size {self.vocab_size}", param="prompt")
            return list(params.prompt), None
        else:
            text, special = params.prompt, True
        parked = self.store.aligned(text)
        if parked is not None:
            return list(parked.tokens) + self.encode(text[len(parked.text):], False), text
        return self.encode(text, special), text

    def __call__(self, params: RequestParams) -> Prepared:
        ids, text = self.prompt(params)
        where = "messages" if params.kind == "chat" else "prompt"
        if not ids:
            raise invalid("the prompt is empty", param=where)
        if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
            # refused before any of it is read: a prompt's reading takes its row for as long as it lasts
            raise context_length_exceeded(
                f"The prompt has {len(ids):,} tokens; this server reads at most {self.max_prompt_tokens:,} per "
                "request (--max-prompt-tokens): shorten it", param=where)
        too_high = [token for token in params.logit_bias if token >= self.vocab_size]
        if too_high:
            raise invalid(f"logit_bias: token id {too_high[0]} is not below the vocabulary size {self.vocab_size}",
                          param="logit_bias")
        if params.max_tokens is not None and params.max_tokens > self.max_tokens_cap:
            raise invalid(f"max_tokens must be at most {self.max_tokens_cap} on this server (--max-tokens), "
                          f"got {params.max_tokens}", param="max_tokens")
        max_tokens = params.max_tokens or self.max_tokens_cap
        if self.bounded:
            room = self.max_context - len(ids)
            if room <= 0 or (params.max_tokens is not None and params.max_tokens > room):
                asked = f" and {params.max_tokens} to generate" if params.max_tokens is not None else ""
                raise context_length_exceeded(
                    f"This server's maximum context length is {self.max_context} tokens; the request has "
                    f"{len(ids)} prompt tokens{asked} (the server keeps absolute positions or a full cache: "
                    "shorten the conversation or max_tokens)", param=where)
            max_tokens = min(max_tokens, room)
        sampling = Sampling(temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                            repetition_penalty=self.repetition_penalty, repeat_last_n=self.repeat_last_n)
        return Prepared(params, ids, text, max_tokens, sampling)
