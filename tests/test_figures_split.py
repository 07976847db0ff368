"""One description of a cache's split (sinks, heavy, recent, recall: capacity and in use) and of its
memory (reserved, in use, what a full cache would hold), and every view printing it (issue 26, items
14 and 15): against counts made here from the slots' token indices by the policy's rules written out
(sinks: the first S tokens; recent: the last R; heavy: the other hot ones; recall: the columns after
the hot ones), in all three families, with and without recall and sinks.
"""

from __future__ import annotations

import io
import json

import pytest
from typer.testing import CliRunner

from h2ochat.chat.conversation import Conversation
from h2ochat.chat.settings import ChatSettings
from h2ochat.cli import app
from h2ochat.engine.generation import CacheSettings, Sampling, stream
from h2ochat.chat.repl import Repl
from h2ochat.chat.split import amount, cache_split, describe_memory, describe_slots, describe_use, format_bytes, kv_memory
from h2ochat.console import make_console
from h2ochat.chat.status import status_line

from conftest import build_model, random_ids
from seeds import seed  # noqa: F401  (fixture)

BUDGET, RECALL, PAGE = 24, 8, 4
# the split of the hot slots, by hand: (policy, recall) -> sinks, heavy, recent, recall
SPLITS = {("h2o", 0): (0, 12, 12, 0), ("mean", 0): (4, 10, 10, 0), ("local", 0): (0, 0, 24, 0),
          ("h2o", RECALL): (0, 8, 8, RECALL), ("mean", RECALL): (4, 6, 6, RECALL)}


def by_hand(cache, sinks: int, recent: int, recall: int) -> dict:
    """Per part, slots holding a token, averaged over (layer, sequence, KV head); and the bytes of the
    slots holding one (fp32 keys and values)."""
    totals = dict(sinks=0, heavy=0, recent=0, recall=0)
    pairs, used_bytes = 0, 0
    for layer in cache.layers:
        index = layer.token_index.tolist()
        hot = len(index[0][0]) - recall
        per_slot = (layer.keys.shape[-1] + layer.values.shape[-1]) * 4
        for row, heads in enumerate(index):
            newest = int(cache.tokens_fed[row]) - 1
            for slots in heads:
                pairs += 1
                for column, token in enumerate(slots):
                    if token < 0:
                        continue
                    used_bytes += per_slot
                    part = ("recall" if column >= hot else "sinks" if token < sinks else
                            "recent" if token > newest - recent else "heavy")
                    totals[part] += 1
    return {"held": {k: v / pairs for k, v in totals.items()}, "bytes": used_bytes}


def use_text(capacity: tuple, held: dict) -> str:
    names = ("sinks", "heavy", "recent", "recall")
    shown = [f"{amount(held[n])}/{c} {n}" for n, c in zip(names, capacity) if c or n in ("heavy", "recent")]
    return f"{amount(sum(held.values()))}/{sum(capacity)} slots held: " + " + ".join(shown)


@pytest.mark.parametrize("policy, recall", list(SPLITS))
@pytest.mark.parametrize("fed", [10, 60])  # before the cache fills, and long after
def test_the_split_counts_what_the_slots_hold(family, policy, recall, fed, seed):
    model = build_model(family, seed=seed)
    settings = CacheSettings(policy=policy, budget=str(BUDGET), recall=str(recall) if recall else None, page=PAGE,
                             selector="exact")
    cache = settings.build(model)
    for _ in stream(model, cache, random_ids(2, 8), max_new_tokens=fed - 7, sampling=Sampling(temperature=1.0, seed=seed)):
        pass
    sinks, heavy, recent, recall_slots = SPLITS[(policy, recall)]
    hand = by_hand(cache, sinks, recent, recall_slots)
    split = cache_split(cache)
    assert (split.slots.sinks, split.slots.heavy, split.slots.recent, split.slots.recall) == SPLITS[(policy, recall)]
    for name, value in hand["held"].items():
        assert getattr(split.held, name) == pytest.approx(value), name
    assert split.held.total <= split.slots.total == BUDGET
    assert split.held.heavy <= heavy and split.held.recent <= recent and split.held.sinks <= sinks
    assert describe_use(split) == use_text(SPLITS[(policy, recall)], hand["held"])

    memory = kv_memory(cache)
    layers, config = len(cache.layers), model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    assert memory.reserved == layers * 2 * kv_heads * BUDGET * 2 * head_dim * 4  # batch 2, keys + values, fp32
    assert memory.in_use == hand["bytes"] <= memory.reserved
    assert memory.full == layers * 2 * kv_heads * fed * 2 * head_dim * 4  # tokens fed: the last one never is
    if fed < BUDGET and not recall:  # nothing evicted yet: in use is what a full cache holds, the reserve more
        assert memory.in_use == memory.full < memory.reserved
    assert describe_memory(memory) == (f"KV {format_bytes(memory.in_use)} in use of {format_bytes(memory.reserved)} "
                                       f"reserved (a full cache: {format_bytes(memory.full)})")


def test_the_full_policy_grows_and_says_so(seed):
    model = build_model("llama", seed=seed)
    cache = CacheSettings(policy="full", budget="8").build(model)
    for _ in stream(model, cache, random_ids(1, 5), max_new_tokens=20, sampling=Sampling(temperature=1.0, seed=seed)):
        pass
    split = cache_split(cache)
    assert split.grows and split.held.total == 24 <= split.slots.total
    assert describe_slots(split).endswith("slots, growing with the text (a full cache: nothing evicted)")
    assert describe_use(split) == f"24/{amount(split.slots.total)} slots held (a full cache: it grows)"


@pytest.fixture(scope="module", params=["opt", "llama", "neox"])
def loaded(request, tmp_path_factory):
    from checkpoints import load_tiny

    return load_tiny(tmp_path_factory, request.param, "split", max_position_embeddings=256)


def chat(loaded, recall=str(RECALL)) -> tuple[Repl, io.StringIO]:
    cache = CacheSettings(policy="h2o", budget=str(BUDGET), recall=recall, page=PAGE, selector="exact")
    conv = Conversation(loaded.model, loaded.tokenizer, ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=20, cache=cache))
    conv.stop_ids = set()
    out = io.StringIO()
    return Repl(conv, make_console(file=out), lambda prompt: "", model_name="tiny"), out


@pytest.mark.parametrize("recall", [str(RECALL), None])
def test_every_chat_view_gives_the_same_split(loaded, recall):
    repl, out = chat(loaded, recall)
    r = RECALL if recall else 0
    hot = (0, 8, 8, RECALL) if recall else (0, 12, 12, 0)
    capacity = "24 slots (" + " + ".join(f"{c} {n}" for n, c in zip(("sinks", "heavy", "recent", "recall"), hot)
                                         if c or n in ("heavy", "recent")) + ")"
    repl.handle("/budget")
    assert f"budget {BUDGET}: " + capacity.replace("slots (", "slots per layer and KV head (") in out.getvalue()
    repl.handle("the quick brown fox jumps over the lazy dog")
    repl.handle("once upon a time there was a dragon")
    cache = repl.conv.cache
    hand = by_hand(cache, 0, hot[2], r)
    used = use_text(hot, hand["held"])
    assert used in status_line(cache) and used in repl.toolbar()
    assert hand["held"]["recall"] > 0 if recall else hand["held"]["recall"] == 0
    repl.handle("/cache")
    text = out.getvalue()
    assert f"· {capacity.replace('slots (', 'slots per layer and KV head (')} ·" in text
    assert f"now {used} (per layer and KV head, averaged)" in text
    assert describe_memory(kv_memory(cache)) in text and describe_memory(kv_memory(cache)) in status_line(cache)

    repl.handle("/policy mean")  # 4 sinks, then half heavy, half recent of the hot slots
    sinks_split = (4, 6, 6, RECALL) if recall else (4, 10, 10, 0)
    shown = " + ".join(f"{c} {n}" for n, c in zip(("sinks", "heavy", "recent", "recall"), sinks_split) if c)
    assert f"policy mean: new cache of 24 slots ({shown}); re-fed the conversation" in out.getvalue()
    cache = repl.conv.cache
    hand = by_hand(cache, 4, sinks_split[2], r)
    assert hand["held"]["sinks"] == 4  # the first four tokens, pinned in every (layer, KV head)
    assert use_text(sinks_split, hand["held"]) in repl.toolbar()
    repl.handle("/set budget 32")
    wider = (4, 10, 10, RECALL) if recall else (4, 14, 14, 0)
    shown = " + ".join(f"{c} {n}" for n, c in zip(("sinks", "heavy", "recent", "recall"), wider) if c)
    assert f"budget 32: new cache of 32 slots ({shown})" in out.getvalue()


def test_story_summary_and_json_give_the_split_and_the_memory(tiny_checkpoint, seed):
    runner = CliRunner()
    args = ["story", "--model", str(tiny_checkpoint), "--budget", "16", "--recall", "8", "--page", "4", "--prompt",
            "once upon a time", "--tokens", "30", "--seed", str(seed)]
    result = runner.invoke(app, args + ["--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert (record["kv_slots"], record["sink_slots"], record["heavy_slots"], record["recent_slots"],
            record["recall_slots"]) == (16, 0, 4, 4, 8)
    held = record["slots_held"]
    assert sum(held.values()) <= 16 and held["recall"] > 0
    assert record["kv_bytes_in_use"] <= record["kv_bytes"] and record["kv_bytes_in_use"] <= record["full_kv_bytes"]
    summary = runner.invoke(app, args).stderr.strip().splitlines()[-1]
    assert "16 slots per layer and KV head (4 heavy + 4 recent + 8 recall): KV " in summary
    assert (f"in use of {format_bytes(record['kv_bytes'])} reserved (a full cache: "
            f"{format_bytes(record['full_kv_bytes'])})") in summary
