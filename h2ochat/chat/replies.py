"""How a reply ends, in every command that generates one (run, generate, story, serve): the token ids
that end it (``stop_token_ids``).

Its own module because generate, story and the server use it without a conversation (chat.py).
"""

from __future__ import annotations

# tokens that end an assistant turn in common chat templates, besides the tokenizer's eos
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def stop_token_ids(tokenizer, model=None) -> set[int]:
    """Ids that end a reply: eos, the generation config's eos list, end-of-turn markers. The one stopping
    rule of every command (run, generate, story --stop-at-eos), so a model that closes its turn with
    <|im_end|> stops everywhere, not only in the chat."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]:
        if value is not None:
            ids.add(int(value))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[name] for name in END_OF_TURN if name in vocab)
    return ids
