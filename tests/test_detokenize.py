"""Streaming text (issue 15, item 6): a SentencePiece-style reply joins its prompt with its space, a
character split over tokens is held back, a base model's reply ends before the "\\nUser:" it starts,
and a first Ctrl-C during a long prompt is heard between its chunks."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from h2ochat.chat.conversation import Conversation
from h2ochat.chat.settings import ChatSettings
from h2ochat.config import Sampling
from h2ochat.engine.detokenize import TextStream, decode_in_context
from h2ochat.engine.generation import CacheSettings
from h2ochat.loading.random_weights import ByteTokenizer

from conftest import build_model
from seeds import fresh, seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("seed")
PROMPT, REPLY = "the end.", "Then it ends.\nUser: more"


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style tokenizer (Metaspace, as Llama-2 and TinyLlama): a word's token carries its
    leading space as '▁', and decoding drops the space of the first token."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([f"{PROMPT} {REPLY} words here"] * 8, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def ids(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("fast", [None, False], ids=["DecodeStream", "window"])
def test_the_first_word_keeps_its_space_after_the_prompt(metaspace, fast):
    prompt, reply = ids(metaspace, PROMPT), ids(metaspace, REPLY)
    whole = metaspace.decode(prompt + reply)
    assert whole == f"{PROMPT} {REPLY}" and not metaspace.decode(reply).startswith(" ")  # the tokenizer's way
    stream = TextStream(metaspace, context=prompt, fast=fast)
    pieces = [stream.push(i) for i in reply]
    assert PROMPT + "".join(pieces) == whole and stream.text == whole[len(PROMPT):]
    assert decode_in_context(metaspace, prompt, reply) == whole[len(PROMPT):]


def test_a_character_split_over_tokens_is_held_back(seed):
    """The byte tokenizer (random-weights models) and the window fallback: 'é' is two ids."""
    tokenizer = ByteTokenizer()
    text = "café ☕ déjà"
    stream = TextStream(tokenizer, context=tokenizer.encode("a "))
    pieces = [stream.push(i) for i in tokenizer.encode(text)]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert pieces[3] == "" and pieces[4] == "é"  # the first byte of 'é' alone shows nothing


def scripted_conversation(tokenizer, monkeypatch, script: list[int], **settings):
    import h2ochat.engine.generation as generation

    fresh("model")
    model = build_model("llama", vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    calls = iter(script)
    monkeypatch.setattr(generation, "sample", lambda logits, *a, **k: torch.full((logits.shape[0],), next(calls)))
    settings.setdefault("max_new_tokens", len(script))
    conv = Conversation(model, tokenizer, ChatSettings.from_values({"temperature": 0.0, **settings}, CacheSettings(budget="1.0")))
    conv.stop_ids = set()
    return conv


def test_a_base_model_reply_ends_before_the_user_turn_it_starts(metaspace, monkeypatch):
    """No chat template: a plain 'User: / Assistant:' transcript. The model writing "\\nUser:" ends
    the reply, and neither the screen nor the stored reply keeps that mark."""
    assert not getattr(metaspace, "chat_template", None)
    conv = scripted_conversation(metaspace, monkeypatch, ids(metaspace, REPLY) + ids(metaspace, " words here"))
    shown = []
    result = conv.send("the end.", on_piece=shown.append)
    assert "".join(shown) == result.text == " Then it ends."  # one token, ' ends.\nUser:', holds the mark
    assert conv.messages[-1]["content"] == " Then it ends."
    assert not result.interrupted
    monkeypatch.setattr("h2ochat.engine.generation.sample", lambda logits, *a, **k: torch.full((1,), 3))
    later = conv.send("more", on_piece=shown.append)  # the next turn reads the cut reply again, quietly
    assert later.notices == [] or all("feeding the whole" not in n for n in later.notices)
    assert conv.render(add_generation_prompt=False).startswith("User: the end.\n\nAssistant: Then it ends.\n\nUser: more")


def test_the_first_ctrl_c_during_a_long_prompt_stops_it_between_chunks(tmp_path, monkeypatch):
    """A first Ctrl-C only asks to stop (the handler sets stop_requested); the prompt's reading must
    hear it at the next chunk, not after minutes of prefill and a first token."""
    import h2ochat.engine.generation as generation
    from checkpoints import write_checkpoint
    from h2ochat.loading.models import load

    fresh("model")
    loaded = load(str(write_checkpoint(tmp_path, max_position_embeddings=512)), device="cpu", dtype="float32")
    conv = Conversation(loaded.model, loaded.tokenizer, ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=4),
                        prefill_chunk=8)
    forwards = []
    real_forward = generation.forward

    def counting(*args, **kwargs):
        forwards.append(args[2].shape[1])
        if len(forwards) == 2:
            conv.stop_requested = True  # what the SIGINT handler does
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(generation, "forward", counting)
    long_message = "the quick brown fox jumps over the lazy dog " * 6  # many chunks of 8 tokens
    result = conv.send(long_message)
    assert forwards == [8, 8] and result.interrupted and result.text == ""
    assert conv.messages[-1] == {"role": "assistant", "content": "", "interrupted": True}
    assert len(conv.ids) == 16 and all(layer.tokens_fed_with_padding == 16 for layer in conv.cache.layers if layer.is_initialized)
    # the rest of the prompt waits as pending tokens; the next turn feeds it first, then goes on
    monkeypatch.setattr(generation, "forward", real_forward)
    conv.send("short")
    assert all(layer.tokens_fed_with_padding == len(conv.ids) for layer in conv.cache.layers if layer.is_initialized)
    assert loaded.tokenizer.decode(conv.ids + conv.pending, skip_special_tokens=False) == conv.fed_text


@pytest.mark.parametrize("pieces, shown, stopped", [
    (["hi", "\n", "Us", "er:", " more"], "hi", True),  # the mark over three pieces: none of it shows
    (["hi", "\n", "Usual", " stuff"], "hi\nUsual stuff", False),  # a start of the mark that was not one
    (["hi\nUser: more"], "hi", True),
    (["a", "\n", "Use"], "a\nUse", False),  # the end of the reply: what was held back is shown
])
def test_reply_text_holds_back_what_may_be_the_stop_mark(pieces, shown, stopped):
    from h2ochat.chat.replies import STOP_MARK, ReplyText

    seen = []
    reply = ReplyText(STOP_MARK, seen.append)
    ended = False
    for piece in pieces:
        if reply.add(piece):
            ended = True
            break  # as Conversation.send does
    reply.finish()
    assert "".join(seen) == reply.text == shown and ended == stopped == reply.stopped
