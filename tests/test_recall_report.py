"""The REPL shows the cold tier (--recall): /cache's cold-tier block, the status line's recall part and
/hh's recalled tokens, against figures worked out by hand from the layers' tensors.

A chat with a tiny random model, 24 device slots = 16 hot + 8 recall, pages of 4: its first turn
already evicts, so the second one recalls. The independent references: every token fed is either in
a hot slot or in the cold store of each (layer, KV head) (so the cold store holds tokens fed - hot
held, less what --cold-limit dropped in whole pages), and every real query row gives each of its
group's query heads one unit of attention mass.
"""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
from rich.control import strip_control_codes

from h2ochat.chat.conversation import Conversation
from h2ochat.chat.settings import ChatSettings
from h2ochat.engine.generation import CacheSettings
from h2ochat.kv import H2OCache
from h2ochat.recall.report import has_cold_tier, recalled_token_indices, summarize_tier
from h2ochat.chat.repl import Repl
from h2ochat.chat.cache_view import RECALLED, STYLES, heavy_hitter_text, token_classes
from h2ochat.chat.split import amount
from h2ochat.console import make_console
from h2ochat.chat.status import percent

from seeds import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("seed")
BUDGET, RECALL, PAGE = 24, 8, 4
HOT = BUDGET - RECALL


@pytest.fixture(scope="module", params=["opt", "llama", "neox"])
def loaded(request, tmp_path_factory):
    from checkpoints import load_tiny

    return load_tiny(tmp_path_factory, request.param, "recall", max_position_embeddings=256)


def chat(loaded, cold_limit=None, recall=str(RECALL), **settings) -> tuple[Repl, io.StringIO]:
    cache = CacheSettings(policy="h2o", budget=str(BUDGET), recall=recall, page=PAGE, selector="exact",
                          cold_limit=cold_limit)
    conv = Conversation(loaded.model, loaded.tokenizer,
                        ChatSettings.from_values({"temperature": 0.0, "max_new_tokens": 20, **settings}, cache))
    conv.stop_ids = set()  # replies run to max_new_tokens whatever the random model writes
    out = io.StringIO()
    return Repl(conv, make_console(file=out), lambda prompt: "", model_name="tiny"), out


def counters(cache) -> list[dict]:
    """Each layer's running totals, copied: pages brought in, attention mass recalled and in all."""
    return [{"copied": layer.tier.frames.copied.clone(), "recalled": layer.tier.recalled_mass.clone(),
             "attended": layer.tier.attended_mass.clone()} for layer in cache.layers]


@pytest.mark.parametrize("cold_limit", [None, 12])
def test_the_cold_tier_figures_are_the_hand_computed_ones(loaded, cold_limit):
    repl, out = chat(loaded, cold_limit)
    conv = repl.conv
    repl.handle("the quick brown fox jumps over the lazy dog")
    cache = conv.cache
    assert has_cold_tier(cache)
    before, fed_before = counters(cache), len(conv.ids)
    repl.handle("once upon a time there was a dragon")
    assert conv.cache is cache  # the turn went on in the same cache
    after, fed = counters(cache), len(conv.ids)
    seen = int(cache.tokens_fed[0])
    assert seen == fed

    rows, pages, tokens, dropped, in_recall = 0, 0, 0, 0, 0
    frames = math.ceil(cold_limit / PAGE) if cold_limit else None
    for layer in cache.layers:
        hot = layer.token_index[0, :, :HOT]
        for head in range(hot.shape[0]):
            rows += 1
            staged = int((layer.tier.staging.slots.token_index[0, head] >= 0).sum())
            evicted = seen - int((hot[head] >= 0).sum()) - staged  # every token fed is hot, staged or cold
            written = math.ceil(evicted / PAGE)
            lost = max(0, written - frames) * PAGE if frames else 0
            pages += written - max(0, written - frames) if frames else written
            tokens += evicted - lost
            dropped += lost
            in_recall += int((layer.token_index[0, head, HOT:] >= 0).sum())
    copied = sum(int(a["copied"].sum()) for a in after)
    copied_turn = copied - sum(int(b["copied"].sum()) for b in before)
    recalled_turn = sum(float((a["recalled"] - b["recalled"]).sum()) for a, b in zip(after, before))
    attended_turn = sum(float((a["attended"] - b["attended"]).sum()) for a, b in zip(after, before))
    group = loaded.model.config.num_attention_heads // cache.layers[0].token_index.shape[1]
    assert attended_turn == pytest.approx(rows * (fed - fed_before) * group)  # one unit per query row and head
    assert copied > 0 and recalled_turn > 0  # the second turn attended recalled tokens
    assert (dropped > 0) == (cold_limit is not None)

    tier = repl.status.summary().tier
    assert tier.this_turn and tier.rows == rows
    assert tier.cold_pages == pytest.approx(pages / rows)
    assert tier.cold_tokens == pytest.approx(tokens / rows)
    assert tier.dropped_tokens == pytest.approx(dropped / rows)
    assert repl.status.summary().split.held.recall == pytest.approx(in_recall / rows)  # the split's (h2ochat/chat/split.py)
    assert tier.pages_copied == pytest.approx(copied / rows)
    assert tier.pages_copied_turn == pytest.approx(copied_turn / rows)
    assert tier.recalled_share_turn == pytest.approx(recalled_turn / attended_turn)
    assert 0 < tier.recalled_share_turn < 1
    # the cold stores and the page means the rest of the cold pages weighs (the C call's: every CPU since session 63)
    assert tier.host_bytes == sum(layer.tier.cold.nbytes() + layer.tier.page_means.nbytes() for layer in cache.layers)
    assert tier.digest_bytes == sum(layer.tier.digest.nbytes() for layer in cache.layers)

    repl.handle("/cache")
    text = out.getvalue()
    assert f" {BUDGET} slots per layer and KV head ({HOT // 2} heavy + {HOT // 2} recent + {RECALL} recall)" in text
    limit = f"--cold-limit {cold_limit}: {amount(dropped / rows)} tokens dropped" if cold_limit else "no --cold-limit"
    assert f"cold store  {amount(pages / rows)} pages ({amount(tokens / rows)} tokens) per layer and KV head" in text
    assert limit in text
    assert (f"recalled    {amount(copied_turn / rows)} pages copied in this turn, {amount(copied / rows)} in all · "
            f"{amount(in_recall / rows)} tokens in recall slots now") in text
    assert f"attention   {percent(recalled_turn / attended_turn)} of the attention this turn went to recalled" in text
    assert (f"recall: {amount(copied_turn / rows)} of {amount(pages / rows)} cold pages in, "
            f"{percent(recalled_turn / attended_turn)} attn") in repl.toolbar()


def test_hh_marks_exactly_the_tokens_in_recall_slots(loaded):
    repl, out = chat(loaded)
    repl.handle("the quick brown fox jumps over the lazy dog")
    repl.handle("once upon a time there was a dragon")
    conv = repl.conv
    by_hand = set()
    for layer in conv.cache.layers:
        held = layer.token_index[0, :, HOT:]
        by_hand |= set(held[held >= 0].tolist())
    assert by_hand and set(recalled_token_indices(conv.cache).tolist()) == by_hand
    ids = conv.ids + conv.pending
    classes = token_classes(conv.cache, len(ids))
    assert {i for i, c in enumerate(classes) if c == RECALLED} == by_hand
    # the transcript styles exactly their text: each run of recalled tokens decoded as one piece
    text = heavy_hitter_text(conv.tokenizer, ids, conv.cache)
    styled = "".join(text.plain[span.start:span.end] for span in text.spans if span.style == STYLES[RECALLED])
    runs, start = [], None
    for index in range(len(ids) + 1):
        inside = index < len(ids) and classes[index] == RECALLED
        if inside and start is None:
            start = index
        elif not inside and start is not None:
            # as shown: rich drops control characters (a random model writes some) from appended text
            runs.append(strip_control_codes(conv.tokenizer.decode(ids[start:index], skip_special_tokens=False)))
            start = None
    assert styled == "".join(runs)
    repl.handle("/hh")
    legend = out.getvalue().strip().splitlines()[-1]
    in_slots = [0] * len(ids)  # how many (layer, KV head) recall slots hold each token
    for layer in conv.cache.layers:
        for token in layer.token_index[0, :, HOT:].flatten().tolist():
            if token >= 0:
                in_slots[token] += 1
    mean = sum(in_slots) / len(by_hand)
    caches = sum(layer.token_index.shape[1] for layer in conv.cache.layers)
    assert legend.startswith(f"{len(ids)} tokens, each held or not in each of the {caches} layer × KV head caches:")
    assert (f"recalled (in a recall slot of at least one of them now, {amount(round(mean, 1))} of them on average; "
            f"marked before heavy): {len(by_hand)}") in legend


def test_turn_figures_count_from_the_turn_start_and_say_so_after_a_new_cache(loaded, monkeypatch):
    repl, out = chat(loaded)
    repl.handle("the quick brown fox jumps over the lazy dog")
    first = repl.status.summary().tier
    assert first.this_turn and first.pages_copied_turn == first.pages_copied > 0  # the first turn is all of it
    reads = []
    original = H2OCache.tier_stats
    monkeypatch.setattr(H2OCache, "tier_stats", lambda self: reads.append(1) or original(self))
    shown = repl.toolbar()
    assert repl.toolbar() == shown and not reads  # redrawn, not read again: nothing was fed
    repl.conv.prefill_chunk = 16  # the re-read below recalls between its chunks
    repl.handle(f"/budget {BUDGET + 4}")  # a new cache, fed the conversation again
    tier = repl.status.summary().tier
    assert not tier.this_turn and tier.pages_copied_turn == tier.pages_copied > 0
    assert len(reads) == 1
    repl.handle("/cache")
    assert f"{amount(tier.pages_copied)} pages copied in since this cache was built" in out.getvalue()
    assert "of the attention since this cache was built went to recalled tokens" in out.getvalue()
    assert len(reads) == 1  # /cache uses the figures the status line read
    reread = tier
    repl.handle("and now a second turn")  # on the new cache: its turn figures count from its start
    reads.clear()
    tier = repl.status.summary().tier
    repl.toolbar()
    assert len(reads) == 1 and tier.this_turn
    assert tier.pages_copied_turn == pytest.approx(tier.pages_copied - reread.pages_copied)


def test_without_recall_nothing_of_the_cold_tier_shows(loaded):
    repl, out = chat(loaded, recall=None)
    repl.handle("the quick brown fox jumps over the lazy dog")
    repl.handle("/cache")
    repl.handle("/hh")
    assert summarize_tier(repl.conv.cache) is None and repl.status.summary().tier is None
    assert recalled_token_indices(repl.conv.cache).numel() == 0
    text = out.getvalue()
    assert "cold tier" not in text and "recall" not in text and "recall" not in repl.toolbar()
    assert torch.tensor([c == RECALLED for c in token_classes(repl.conv.cache, len(repl.conv.ids))]).sum() == 0
    assert re.search(r"heavy hitter \(held on merit in at least half of them\): \d+   partly evicted \(held in fewer "
                     r"than half\): \d+", text.splitlines()[-1])
