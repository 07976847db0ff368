"""Conversation: feeding only what is new, interruption, settings, saving, eviction notices."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from h2ochat.chat import conversation as chat_module
from h2ochat.chat.conversation import Conversation
from h2ochat.chat.settings import ChatSettings
from h2ochat.config import Sampling
from h2ochat.chat.replies import stop_token_ids
from h2ochat.errors import UserError
from h2ochat.engine.generation import CacheSettings
from h2ochat.loading.models import load

from checkpoints import writing
from seeds import fresh, seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("seed")  # every test prints its seeds (and the model's) if it fails


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """A tiny random Llama with room for a few turns (512 positions) and a chat template."""
    from checkpoints import write_checkpoint

    fresh("model")
    return write_checkpoint(tmp_path_factory.mktemp("chat-llama"), max_position_embeddings=512)


@pytest.fixture(scope="module")
def loaded(long_checkpoint):
    return load(str(long_checkpoint), device="cpu", dtype="float32")


def conversation(loaded, budget="1.0", **settings):
    settings.setdefault("temperature", 0.0)
    settings.setdefault("max_new_tokens", 6)
    cache = CacheSettings(budget=budget, policy=settings.pop("policy", "h2o"))
    return Conversation(loaded.model, loaded.tokenizer, ChatSettings.from_values(settings, cache))


def assert_consistent(conv: Conversation) -> None:
    """The cache holds exactly ``ids`` and the tokens spell the rendered conversation."""
    assert all(layer.tokens_fed_with_padding == len(conv.ids) for layer in conv.cache.layers if layer.is_initialized)
    assert conv.tokenizer.decode(conv.ids + conv.pending, skip_special_tokens=False) == conv.fed_text
    assert conv.render(add_generation_prompt=False).startswith(conv.fed_text)


def assert_greedy_under_full_attention(model, prompt: list[int], reply: list[int], tolerance: float = 1e-4) -> None:
    """Each reply token is the argmax of a plain full-attention forward of everything before it, up to
    ``tolerance`` (two fp32 implementations may order a near-tie either way: the reference is fed the
    reply's own tokens, so one such tie does not derail the rest of the comparison)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + reply]), use_cache=False).logits[0]
    for step, token in enumerate(reply):
        row = logits[len(prompt) - 1 + step]
        assert float(row.max() - row[token]) <= tolerance * max(1.0, float(row.abs().max())), (step, token)


def test_second_turn_feeds_only_the_new_suffix_and_matches_full_attention(loaded, long_checkpoint):
    conv = conversation(loaded, system="be brief")
    words = ["fox", "dog", "dragon", "lazy", "quick", "brown"]
    first = " ".join(words[i] for i in torch.randperm(len(words))[:3].tolist())
    conv.send(first)
    assert_consistent(conv)
    before = len(conv.ids)
    result = conv.send("once upon a time")
    assert_consistent(conv)
    # only the new turn was read, not the whole history again
    assert 0 < result.timing.prompt_tokens < len(conv.ids)
    prompt_end = before + result.timing.prompt_tokens
    everything = conv.ids + conv.pending
    reply = everything[prompt_end:]
    reference_model = AutoModelForCausalLM.from_pretrained(str(long_checkpoint), attn_implementation="sdpa").eval()
    assert_greedy_under_full_attention(reference_model, everything[:prompt_end], reply)


def test_interrupted_reply_keeps_partial_text_and_session(loaded, monkeypatch):
    conv = conversation(loaded, budget="24", max_new_tokens=60)
    conv.stop_ids = set()  # a random model may end its reply before the interruption otherwise
    seen = []
    real_steps = chat_module.inference_steps

    def ctrl_c_after_three_tokens(steps):
        # counted in tokens, not text pieces: a random model's first tokens may spell no text at all
        for count, step in enumerate(real_steps(steps)):
            if count == 3:
                raise KeyboardInterrupt
            yield step

    monkeypatch.setattr(chat_module, "inference_steps", ctrl_c_after_three_tokens)
    impatient = seen.append
    result = conv.send("the lazy dog", on_piece=impatient)
    assert result.interrupted
    assert conv.messages[-1]["interrupted"] is True
    assert result.text.startswith("".join(seen)) or "".join(seen).startswith(result.text)
    assert_consistent(conv)
    monkeypatch.undo()  # no more Ctrl-C
    after = conv.send("go on")  # the session goes on, on the same cache
    assert not after.interrupted
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    assert_consistent(conv)


def test_stop_requested_ends_after_the_current_token(loaded):
    conv = conversation(loaded, max_new_tokens=30)
    conv.stop_ids = set()
    count = []

    def stop_soon(piece):
        count.append(piece)
        conv.stop_requested = True

    with writing(loaded.model, loaded.tokenizer):  # text, whatever the random weights would write
        result = conv.send("hello", on_piece=stop_soon)
    # stops at the first token that completed a piece of text (some bytes wait for the next token)
    assert result.interrupted and len(count) == 1 and result.timing.generated_tokens < 30
    assert result.text == count[0]
    assert_consistent(conv)


@pytest.mark.parametrize("name, value, attribute, expected", [
    ("temperature", "0.35", "temperature", 0.35),
    ("top-p", "0.9", "top_p", 0.9),
    ("top_k", "7", "top_k", 7),
    ("seed", "42", "seed", 42),
    ("max_tokens", "33", "max_new_tokens", 33),
    ("repeat-last-n", "128", "repeat_last_n", 128),
    ("system", "talk like a pirate", "system", "talk like a pirate"),
])
def test_set_changes_the_named_setting(name, value, attribute, expected):
    settings = ChatSettings()
    changed, canonical = settings.with_value(name, value)
    assert canonical == attribute
    assert changed.get(attribute) == expected
    assert settings == ChatSettings()  # a copy changes, never the settings in use


@pytest.mark.parametrize("name, value", [("temperature", "-1"), ("top_p", "0"), ("top_k", "many"),
                                         ("max_new_tokens", "0"), ("colour", "blue"), ("heavy_ratio", "1.5"),
                                         ("repeat_last_n", "-5")])
def test_set_refuses_bad_values_and_keeps_the_old_one(name, value):
    settings = ChatSettings()
    before = settings.to_json()
    with pytest.raises(UserError):
        settings.with_value(name, value)
    assert settings.to_json() == before


def test_json_round_trip_restores_messages_settings_and_cache(loaded):
    conv = conversation(loaded, system="you are terse", budget="20", temperature=0.5, seed=3)
    conv.send("quick brown fox")
    conv.send("lazy dog")
    saved = conv.to_json()
    other = conversation(loaded)
    fed = other.load_json(saved)
    assert other.messages == conv.messages
    assert other.settings.to_json() == conv.settings.to_json()
    assert other.cache.budget.slots == 20
    assert fed == len(other.encode(other.render(add_generation_prompt=False))) == other.cache.longest_row_tokens()
    assert_consistent(other)
    other.send("and then?")
    assert_consistent(other)


def test_load_refuses_a_foreign_file(loaded):
    conv = conversation(loaded)
    with pytest.raises(ValueError):
        conv.load_json({"messages": []})
    with pytest.raises(ValueError):
        conv.load_json({"format": "h2ochat-conversation", "messages": [{"role": "user"}]})


def test_rebuild_with_a_new_budget_refeeds_the_conversation(loaded):
    conv = conversation(loaded, budget="1.0")
    conv.send("the quick brown fox")
    total = len(conv.ids) + len(conv.pending)
    conv.settings.cache.budget = "12"
    conv.rebuild()
    assert conv.cache.budget.slots == 12
    assert conv.cache.longest_row_tokens() == len(conv.ids) >= total - 1
    assert all(stats.held == 12 for stats in conv.cache.layer_stats())
    assert_consistent(conv)


def test_eviction_notices_come_once(loaded):
    conv = conversation(loaded, budget="16", system="a fairly long system prompt about foxes and dogs",
                        max_new_tokens=12)
    first = conv.send("hi")
    notes = first.notices + conv.send("more").notices + conv.send("again").notices
    assert sum("system prompt" in n for n in notes) == 1
    assert sum("first turn" in n for n in notes) == 1


def test_no_notice_while_everything_fits(loaded):
    conv = conversation(loaded, budget="1.0", system="short")
    assert conv.send("hi").notices == []
    assert conv.send("hello").notices == []


def test_base_model_without_template_gets_a_plain_transcript(loaded):
    import copy

    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = None
    conv = Conversation(loaded.model, tokenizer, ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=5, system="notes"))
    conv.send("hello")
    conv.send("again")
    text = conv.render(add_generation_prompt=True)
    assert text.startswith("notes\n\nUser: hello\n\nAssistant:") and text.endswith("User: again\n\nAssistant:" +
                                                                                 conv.messages[-1]["content"] +
                                                                                 "\n\nAssistant:")
    assert_consistent(conv)


def test_a_failed_turn_leaves_no_trace(loaded, monkeypatch):
    conv = conversation(loaded)
    conv.send("hello")
    before = [dict(m) for m in conv.messages]

    def broken(*args, **kwargs):
        raise RuntimeError("device fell over")

    monkeypatch.setattr("h2ochat.chat.conversation.stream", broken)
    with pytest.raises(RuntimeError):
        conv.send("again")
    assert conv.messages == before
    monkeypatch.undo()
    conv.send("again")  # starts over from a fresh cache, consistently
    assert_consistent(conv)


def test_one_stop_rule_eos_and_end_of_turn_markers(loaded):
    vocab = loaded.tokenizer.get_vocab()
    assert stop_token_ids(loaded.tokenizer, loaded.model) == {vocab["</s>"], vocab["<|end|>"]}
    loaded.model.generation_config.eos_token_id = [vocab["</s>"], 7]  # a config listing more ends
    try:
        assert stop_token_ids(loaded.tokenizer, loaded.model) == {vocab["</s>"], vocab["<|end|>"], 7}
    finally:
        loaded.model.generation_config.eos_token_id = vocab["</s>"]


def test_repeat_last_n_reaches_the_sampler_and_is_kept(loaded):
    conv = conversation(loaded, repetition_penalty=1.3, repeat_last_n=5)
    assert conv.settings.sampling.repeat_last_n == 5
    assert ChatSettings.from_json(conv.settings.to_json()).sampling.repeat_last_n == 5


def cache_state(cache) -> dict[str, torch.Tensor]:
    state = {f"{index}.{name}": t.clone() for index, layer in enumerate(cache.layers)
             for name, t in layer.state_tensors().items()}
    return {**state, "tokens_fed": cache.tokens_fed.clone(), "next_position": cache.next_position.clone()}


def test_replies_in_bursts_feed_the_cache_exactly_as_token_by_token(loaded, monkeypatch):
    """A chat reading the stop check once per 4 tokens (what a GPU does, forced on the CPU), its replies
    ending on a stop id inside a burst: over three turns the same replies, the same cache bit for bit
    and the same counters as reading it after every token, and no turn reads the conversation again."""
    probe = conversation(loaded, budget="24", max_new_tokens=12)
    probe.stop_ids = set()
    first = probe.send("the quick brown fox").text
    tokens = probe.ids[-11:] + probe.pending  # the first reply's 12 tokens
    # a stop id whose first appearance in that reply is not a burst's last step (so steps after it queue)
    firsts = {token: tokens.index(token) for token in reversed(tokens)}
    stop = next(token for token, at in sorted(firsts.items(), key=lambda item: -item[1]) if at % 4 != 3)
    assert first  # (a reply was produced)
    runs, bursts = {}, []
    real_stream = chat_module.stream

    def spy(*args, **kwargs):
        bursts.append(kwargs["stop_check_every"])
        return real_stream(*args, **kwargs)

    monkeypatch.setattr(chat_module, "stream", spy)
    for every in (1, 4):
        conv = conversation(loaded, budget="24", max_new_tokens=12)
        conv.stop_check_every = every
        conv.stop_ids = {stop}
        turns = []
        for text in ("the quick brown fox", "once upon a time", "go on"):
            result = conv.send(text)
            assert not any("again" in notice for notice in result.notices), result.notices
            assert_consistent(conv)
            if len(turns):
                assert result.timing.prompt_tokens < len(conv.ids)  # only the new turn was read
            turns.append((result.text, result.timing.generated_tokens, list(conv.ids), list(conv.pending),
                          conv.fed_text, cache_state(conv.cache), conv.cache.host_counters()))
        runs[every] = turns
    assert bursts == [1] * 3 + [4] * 3
    assert runs[4][0][1] == firsts[stop] + 1  # the first reply stopped on the stop id, inside a burst
    for one, four in zip(runs[1], runs[4]):
        assert one[:5] == four[:5]
        assert one[5].keys() == four[5].keys() and all(torch.equal(one[5][k], four[5][k]) for k in one[5])
        assert one[6] == four[6]


def test_a_base_model_reply_cut_inside_a_burst_is_read_again(loaded, monkeypatch):
    """A base model's reply ends where it writes "\\nUser:", which the device cannot see: in a burst of 4
    the cache has read on to the burst's end. The next turn reads the conversation again, quietly,
    and the chat then stands exactly where the token-by-token chat stands (same replies, same cache)."""
    import copy

    import h2ochat.engine.generation as generation

    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = None
    reply = tokenizer(" hi\nUser: more words here and on", add_special_tokens=False).input_ids
    filler = tokenizer(" ok", add_special_tokens=False).input_ids[-1]
    mark_at = next(i for i in range(len(reply)) if "\nUser:" in tokenizer.decode(reply[: i + 1]))
    if mark_at % 4 == 3:  # a burst's last step: one more token before it, so steps queue after the mark
        reply, mark_at = [filler] + reply, mark_at + 1
    assert mark_at + 1 < len(reply)
    runs = {}
    for every in (1, 4):
        script = iter(reply + [filler] * 40)
        monkeypatch.setattr(generation, "sample", lambda logits, *a, **k: torch.full((logits.shape[0],), next(script)))
        conv = Conversation(loaded.model, tokenizer, ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=12),
                            stop_check_every=every)
        conv.stop_ids = {tokenizer.eos_token_id}  # never drawn; stop ids make the reads come in bursts
        first = conv.send("hello")
        script = iter(reply[::-1] + [filler] * 40)  # each turn its own script, however far the burst drew
        second = conv.send("again")
        assert first.text.endswith(" hi") and all("again" not in notice for notice in second.notices)
        assert_consistent(conv)
        runs[every] = (first.text, second.text, list(conv.ids), list(conv.pending), cache_state(conv.cache))
    assert runs[1][:4] == runs[4][:4]
    assert all(torch.equal(runs[1][4][name], runs[4][4][name]) for name in runs[1][4])
