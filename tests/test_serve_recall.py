"""`h2ochat serve --recall R`: each row of the batch has its own cold tier, a finished conversation
parks it in host memory with the rest of its cache (``Tier.export_row``, counted in --parked-bytes) and
a resumed one gets it back (``Tier.import_row``).

On the engine (tiny OPT, Llama-GQA and GPT-NeoX, no HTTP): a parked row's state survives being
imported and exported again bit for bit, wherever it goes (a 1-row prefill cache, another row of a
batch whose stores are larger); it holds the cold tokens the row holds, not the batch's capacity; the
row a conversation leaves hands nothing of it to the next one (its tokens equal the same request on a
server that never ran the first); a free row sits the steps out and its cold store stays empty, and the
stores grow with the longest conversation, not with the server's uptime. Through HTTP: a multi-turn
chat on a recall server equals the REPL's chat with the same recall settings, turn after turn
(each resuming its parked cache), with the pages recalled in ``usage`` and the tier's bytes in /metrics.
"""

from __future__ import annotations

import random

import openai
import pytest
import torch

from h2ochat.chat.conversation import ChatSettings, Conversation
from h2ochat.config import Sampling
from h2ochat.engine.generation import CacheSettings
from h2ochat.loading.models import load

from conftest import EXACT, VOCAB, build_model
from serve_fakes import chat_beside_the_repl, drain, generated, make_request, model_engine
from serve_harness import fresh_checkpoint, running

ROWS, BUDGET, CHUNK = 3, "16", 5
RECALL = dict(recall="8", page=4)


def engine(model, rows=ROWS, **kwargs):
    return model_engine(model, rows, budget=BUDGET, chunk=CHUNK, cache=RECALL, **kwargs)


def prompt(rng, low=20, high=40):
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))]


def served(scheduler, ids, tokens):
    request = make_request(ids, max_tokens=tokens, stop_ids=())
    scheduler.submit(request)
    drain(scheduler)
    assert request.events[-1][0] == "done", request.events[-1]
    return request


def archived(layer: dict, page: int) -> list[tuple]:
    """Per KV head, what one layer of a row state holds beyond its hot and recall slots, in eviction
    order: its cold tokens, then its staged ones (the last page of the slot columns): (token index,
    position, key, value) each."""
    out = []
    held = layer["cold_count"]
    for head in range(held.shape[0]):
        cold = slice(0, int(held[head]))
        staged = layer["token_index"][head, -page:] >= 0
        out.append(tuple(torch.cat([layer[f"cold_{name}"][head, cold], layer[name][head, -page:][staged]])
                         for name in ("token_index", "positions", "keys", "values")))
    return out


def same_row(a, b, page: int) -> None:
    """Two row states hold the same: the same hot and recall slots and counters bit for bit, and the
    same evicted tokens in the same order, whether staged or already in the cold store (an import
    flushes the staging page: ``RecallTier._fold_staged``)."""
    assert len(a.layers) == len(b.layers)
    for index, (mine, theirs) in enumerate(zip(a.layers, b.layers)):
        assert set(mine) == set(theirs), f"layer {index}"
        for name in ("keys", "values", "scores", "token_index", "positions", "evicted", "evicted_share"):
            assert torch.equal(mine[name][..., :-page], theirs[name][..., :-page]) if mine[name].dim() > 1 \
                else torch.equal(mine[name], theirs[name]), f"layer {index} {name}"
        for head, (x, y) in enumerate(zip(archived(mine, page), archived(theirs, page))):
            assert all(torch.equal(u, v) for u, v in zip(x, y)), f"layer {index} head {head}: other evicted tokens"
    for name in a.counters:
        assert torch.equal(a.counters[name], b.counters[name]), name


def test_a_parked_recall_row_comes_back_bit_for_bit_and_holds_what_it_holds(family, seed):
    rng = random.Random(seed)
    # (the cold store at the model's dtype: a staged token and the same token flushed compare equal)
    # (one bucket: each chat rests in a row of its own; with buckets the next chat would take the smallest's)
    scheduler, store = model_engine(build_model(family), ROWS, budget=BUDGET, chunk=CHUNK,
                                    cache={**RECALL, "cold_dtype": EXACT}, buckets=(ROWS,))
    backend = scheduler.backend
    served(scheduler, prompt(rng, 50, 60), 40)  # fills its row's cold store: the batch's grows for it
    served(scheduler, prompt(rng, 20, 24), 4)  # a short one: its row holds a few cold tokens only
    assert len(store) == 2 and sorted(backend.pool.resting) == [0, 1]  # (both rest in their rows)
    # three tiny chats take row 2 (empty), then the rows resting longest, 0 and 1: the long and the short
    # one are copied out to host memory
    for _ in range(3):
        served(scheduler, prompt(rng, 4, 4), 1)
    settled = [entry for entry in store._entries.values() if entry.row is None]
    assert len(store) == 5 and len(settled) == 2
    short = min(settled, key=lambda entry: len(entry.tokens))
    long = max(settled, key=lambda entry: len(entry.tokens))
    state = short.state
    backend.cache.import_row(1, long.state)  # (the batch's stores grow for the long one again)
    for saved, layer in zip(state.layers, backend.cache.layers):
        cold = layer.tier.cold
        held = int(saved["cold_count"].max())
        assert 0 < held < cold.capacity  # the batch's store is larger than this row needs
        assert saved["cold_keys"].shape[1] == held and saved["cold_token_index"].shape[1] == held
        assert (saved["cold_token_index"] >= 0).sum() == saved["cold_count"].sum()  # every one kept
    assert short.nbytes == state.nbytes and store.nbytes == sum(entry.nbytes for entry in store._entries.values())
    # into a fresh 1-row cache (what a resumed request is prefilled on), and into row 2 of the batch
    # cache, whose stores are larger: exported again, the same tokens, keys and values
    page = RECALL["page"]
    alone = backend._new_cache(1, static_shapes=False)
    alone.import_row(0, state)
    same_row(alone.export_row(0), state, page)
    backend.cache.import_row(2, state)
    same_row(backend.cache.export_row(2), state, page)
    backend.release(2, None)
    backend.release(1, None)
    # the long row gone, the batch's cold stores give its room back (whole pages, at least one)
    assert all(layer.tier.cold.capacity == page for layer in backend.cache.layers)


def test_a_resumed_recall_conversation_reads_only_its_new_tokens_and_counts_its_pages(family, seed):
    rng = random.Random(seed)
    scheduler, store = engine(build_model(family))
    first = served(scheduler, prompt(rng), 20)
    follow = first.prompt_ids + generated(first)[0] + prompt(rng, 3, 9)
    second = served(scheduler, follow, 12)
    fed_before = len(first.prompt_ids) + 20 - 1
    assert second.cached_tokens == fed_before and second.fed_ids == follow[fed_before:]
    assert len(store) == 1
    usage = [request.usage()["recalled_pages"] for request in (first, second)]
    assert all(pages > 0 for pages in usage)  # (every decode step recalls: a page a step at least once full)
    # the parked conversation counts every page its rows recalled, both turns together
    entry, backend = next(iter(store._entries.values())), scheduler.backend
    assert entry.row is not None  # it rests in its row: its next turn reads it from there
    parked = backend.pool.parked_state(entry)
    assert sum(int(layer["frames_copied"].sum()) for layer in parked.layers) == sum(usage)


def test_a_rows_cold_tier_does_not_leak_into_the_next_conversation(family, seed):
    """A long conversation in row 0, then another request in the same row: its tokens are those of the
    same request on a server that never ran the first, and its row's cold store holds its own tokens only."""
    rng = random.Random(seed)
    model = build_model(family)
    long, short = prompt(rng, 40, 60), prompt(rng)
    used, _ = engine(model, store_bytes=0)  # (nothing parked: the second request cannot resume the first)
    served(used, long, 60)
    again = served(used, short, 25)
    fresh_server, _ = engine(model, store_bytes=0)
    reference = served(fresh_server, short, 25)
    assert generated(again) == generated(reference)
    for mine, theirs in zip(used.backend.cache.layers, fresh_server.backend.cache.layers):
        assert torch.equal(mine.tier.cold.count, theirs.tier.cold.count)


def test_free_rows_keep_their_cold_tier_empty_and_the_stores_grow_with_the_longest_conversation(family, seed):
    rng = random.Random(seed)
    scheduler, _ = engine(build_model(family), rows=4, buckets=(4,))  # (one bucket: each chat rests in its own row)
    backend = scheduler.backend
    capacities = []
    for number in range(5):  # one conversation at a time: the free rows left out of every step
        served(scheduler, prompt(rng, 20, 30), 40)
        capacities.append(backend.cache.layers[0].tier.cold.capacity)
        held = sorted(backend.pool.resting)  # (each ended chat rests in its row, until a newcomer needs it)
        assert len(held) == min(number + 1, 4)
        for layer in backend.cache.layers:  # (a free row that never held a chat never evicted into its store)
            assert all(int(layer.tier.cold.count[row].sum()) == 0 for row in range(4) if row not in held)
    # 5 x 40 decode steps and their prompts in all, but no conversation passed 70 tokens: the store
    # doubles past what the longest holds (64 -> 128), not to what the batch was fed (256, 512)
    assert max(capacities) <= 128 and capacities == sorted(capacities)


# -- through HTTP ----------------------------------------------------------------------------------
# each turn's prompt is read in one piece (the server's default chunk, 512, is longer than any turn
# here): a prompt whose last piece is one token stages that token's victim in the 1-row prefill
# cache, and the row's flush when it joins the batch then comes earlier than the REPL's
HTTP_BUDGET, HTTP_RECALL, HTTP_PAGE, HTTP_ROWS, HTTP_CHUNK = 16, 8, 4, 3, 512


@pytest.fixture(scope="module")
def recall_server(tmp_path_factory):
    """(the checkpoint, a live recall server on it)"""
    checkpoint = fresh_checkpoint(tmp_path_factory, "serve-recall-model")
    options = ("--budget", str(HTTP_BUDGET), "--policy", "h2o", "--recall", str(HTTP_RECALL), "--page", str(HTTP_PAGE),
               "--max-sequences", str(HTTP_ROWS), "--prefill-chunk", str(HTTP_CHUNK), "--parked-bytes", "64MiB")
    with running(checkpoint, *options, log_dir=tmp_path_factory.mktemp("serve-recall-log")) as process:
        yield checkpoint, process


def test_a_served_chat_with_recall_equals_the_repl_turn_after_turn(recall_server, seed):
    """Each turn resumes the cache the last one parked, cold tier included: the replies are the REPL's
    with the same recall settings (the REPL's 1-row cache is never parked)."""
    rng = random.Random(seed)
    checkpoint, server = recall_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    loaded = load(str(checkpoint), "cpu", "float32")
    settings = CacheSettings(policy="h2o", budget=str(HTTP_BUDGET), recall=str(HTTP_RECALL), page=HTTP_PAGE)
    repl = Conversation(loaded.model, loaded.tokenizer, ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=12, cache=settings),
                        prefill_chunk=HTTP_CHUNK)
    previous, pages = None, 0
    for turn, reply, expected in chat_beside_the_repl(client, server.model, repl, rng):
        assert reply.choices[0].message.content == expected.text, f"turn {turn + 1}"
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert cached == (0 if previous is None else previous.prompt_tokens + previous.completion_tokens - 1)
        pages += reply.usage.model_extra["recalled_pages"]
        previous = reply.usage
    assert previous.prompt_tokens > 3 * HTTP_BUDGET and pages > 0
    # (the gauges follow the engine's steps, the tier's at most once a second)
    values = server.wait_metrics(lambda v: v.get("recall_cold_host_bytes", 0) > 0 and v["parked_in_rows"] > 0, timeout=30)
    # (the default selector on a CPU scores the cold store's own keys: no selector bytes of its own)
    assert values["recall_selector_device_bytes"] == 0
    # the chat rests in the row that ran it, parked there: no host bytes of its own (nothing copied out)
    assert values["parked_in_rows"] == values["parked_conversations"] and values["parked_bytes"] == 0
    assert 0 < values["recall_cold_host_bytes_written"] <= values["recall_cold_host_bytes"]
