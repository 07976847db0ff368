"""The cold store and the recall frames against slow, obvious references (Python lists per head)."""

from __future__ import annotations

import random

import pytest
import torch

from h2ochat.kv import Renumbering
from conftest import EXACT
from h2ochat.recall.cold_store import ColdStore
from h2ochat.recall.step import RecallFrames
from h2ochat.rotary import Rotary, rotate_keys

B, H, D = 2, 3, 8


def _evictions(steps: int, rng: random.Random):
    """Random evictions: per step and (sequence, head) 0-3 tokens, numbered as a cache would."""
    next_index = [[0] * H for _ in range(B)]
    for _ in range(steps):
        width = 3
        token_index = torch.full((B, H, width), -1, dtype=torch.long)
        for b in range(B):
            for h in range(H):
                for e in range(width):
                    if rng.random() < 0.5:
                        token_index[b, h, e] = next_index[b][h]
                        next_index[b][h] += 1
        keys = torch.randn(B, H, width, D)
        values = torch.randn(B, H, width, D)
        positions = token_index * 2  # any per-token value, to check it travels with the token
        yield keys, values, token_index, positions


def _reference(events, page, limit):
    """Per (sequence, head): the list of (token index, position, key, value) still held."""
    held = [[[] for _ in range(H)] for _ in range(B)]
    dropped = [[0] * H for _ in range(B)]
    frames = -(-limit // page) if limit is not None else None
    for keys, values, token_index, positions in events:
        for b in range(B):
            for h in range(H):
                for e in range(token_index.shape[2]):
                    if token_index[b, h, e] >= 0:
                        held[b][h].append((int(token_index[b, h, e]), int(positions[b, h, e]), keys[b, h, e], values[b, h, e]))
                        appended = len(held[b][h]) + dropped[b][h]
                        # a new page beyond the ring's frames drops the oldest whole page
                        if frames is not None and -(-appended // page) - dropped[b][h] // page > frames:
                            held[b][h] = held[b][h][page:]
                            dropped[b][h] += page
    return held, dropped


@pytest.mark.parametrize("limit", [None, 8, 12])
@pytest.mark.parametrize("page", [1, 4])
def test_store_holds_exactly_the_evicted_tokens(seed, page, limit):
    if limit is not None and limit < page:
        pytest.skip("a limit under one page is refused")
    events = list(_evictions(12, random.Random(seed)))
    store = ColdStore(B, H, D, D, page, torch.float32, limit=limit, initial_pages=1, cold_dtype=EXACT)
    for event in events:
        store.append(*event)
    held, dropped = _reference(events, page, limit)
    first, end = store.held()
    pages = torch.arange(int(end.max())).expand(B, H, -1)
    keys, values, token_index, positions = store.pages(pages)
    for b in range(B):
        for h in range(H):
            got = token_index[b, h]
            mask = got >= 0
            assert got[mask].tolist() == [t for t, *_ in held[b][h]]  # nothing lost, nothing duplicated, in order
            assert positions[b, h][mask].tolist() == [p for _, p, *_ in held[b][h]]
            if held[b][h]:
                assert torch.equal(keys[b, h][mask], torch.stack([k for *_, k, _ in held[b][h]]))
                assert torch.equal(values[b, h][mask], torch.stack([v for *_, v in held[b][h]]))
            assert int(store.dropped()[b, h]) == dropped[b][h]
            assert int(store.held_tokens()[b, h]) == len(held[b][h])


@pytest.mark.parametrize("cold_dtype", ["model", "int8-values", "int8"])
@pytest.mark.parametrize("limit", [None, 8])
def test_pages_named_one_by_one_are_the_pages_laid_out(seed, limit, cold_dtype):
    """``page_tokens`` (a CPU step's loaded pages, by row, head and page) gives for each page what
    ``pages`` gives at that (row, head, k): pages past the end, dropped by the ring, or -1 included,
    with keys rotated after a re-numbering."""
    rng = random.Random(seed)
    rotary = Rotary(inv_freq=1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), rotary_dim=D)
    store = ColdStore(B, H, D, D, 4, torch.float32, limit=limit, cold_dtype=cold_dtype)
    for event in _evictions(10, rng):
        store.append(*event)
    store.positions += 3  # (as a re-numbering leaves them: keys come back turned by the difference)
    store.moved = True
    pages = torch.tensor([[[rng.randrange(-1, 6) for _ in range(3)] for _ in range(H)] for _ in range(B)])
    laid_out = store.pages(pages, rotary)
    row, head, k = (t.flatten() for t in torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(3), indexing="ij"))
    one_by_one = store.page_tokens(row, head, pages[row, head, k], rotary)
    for got, want in zip(one_by_one, laid_out):
        assert torch.equal(got, want.unflatten(2, (3, 4))[row, head, k])


@pytest.mark.parametrize("cold_dtype", ["int8", "int8-values"])
def test_int8_store_is_within_half_a_step(seed, cold_dtype):
    """int8 codes come back within half a quantisation step of what was stored; int8-values keeps the
    keys exact."""
    events = list(_evictions(6, random.Random(seed)))
    store = ColdStore(B, H, D, D, 4, torch.float32, cold_dtype=cold_dtype)
    plain = ColdStore(B, H, D, D, 4, torch.float32, cold_dtype="model")
    for event in events:
        store.append(*event)
        plain.append(*event)
    pages = torch.arange(int(store.held()[1].max())).expand(B, H, -1)
    got, want = store.pages(pages), plain.pages(pages)
    assert torch.equal(got[2], want[2])
    if cold_dtype == "int8-values":
        assert torch.equal(got[0], want[0])
    for approx, exact in zip(got[:2] if cold_dtype == "int8" else got[1:2], want[:2] if cold_dtype == "int8" else want[1:2]):
        step = exact.abs().amax(dim=-1, keepdim=True) / 127
        assert bool(((approx - exact).abs() <= step / 2 + 1e-6).all())
    assert store.nbytes() < plain.nbytes()


@pytest.mark.parametrize("dtype,keys,cold_dtype", [(torch.float32, torch.bfloat16, "bf16-keys"),
                                                   (torch.bfloat16, torch.bfloat16, "int8-values"),
                                                   (torch.float16, torch.float16, "int8-values")])
def test_auto_keeps_int8_values_and_keys_of_16_bits(seed, dtype, keys, cold_dtype):
    """auto: an fp32 model's keys in bf16 (half their bytes), a 16-bit model's as they are; values as int8
    codes. A page comes back with the keys rounded to bf16 once (widened exactly), values as int8-values
    brings them, and its host bytes are int8-values' less half the fp32 keys'."""
    events = list(_evictions(6, random.Random(seed)))
    store = ColdStore(B, H, D, D, 4, dtype, cold_dtype="auto")
    values_only = ColdStore(B, H, D, D, 4, dtype, cold_dtype="int8-values")
    assert (store.cold_dtype, store.key_dtype, store.keys.dtype) == (cold_dtype, keys, keys)
    for event in events:
        store.append(*(part.to(dtype) if part.is_floating_point() else part for part in event))
        values_only.append(*(part.to(dtype) if part.is_floating_point() else part for part in event))
    pages = torch.arange(int(store.held()[1].max())).expand(B, H, -1)
    got, want = store.pages(pages), values_only.pages(pages)
    assert got[0].dtype == dtype and torch.equal(got[0], want[0].to(keys).to(dtype))
    assert all(torch.equal(a, b) for a, b in zip(got[1:], want[1:]))
    key_bytes = store.keys.numel() * (dtype.itemsize - keys.itemsize)
    assert store.nbytes() == values_only.nbytes() - key_bytes
    queries = torch.randn(B, H, 3, D, dtype=dtype)
    assert store.scored_queries(queries).dtype == keys


def test_store_refuses_bad_settings():
    with pytest.raises(ValueError, match="cold-dtype must be one of auto, model, int8-values, bf16-keys, int8"):
        ColdStore(1, 1, 4, 4, 4, torch.float32, cold_dtype="int3")
    assert ColdStore(1, 1, 4, 4, 4, torch.float32, cold_dtype="same").cold_dtype == "model"  # its old name
    with pytest.raises(ValueError, match="less than one page"):
        ColdStore(1, 1, 4, 4, 16, torch.float32, limit=8)


def test_renumber_keeps_order_and_recalled_keys_sit_at_their_new_position(seed):
    """A cold token takes the new position of the first hot token after it; its key comes back
    rotated from the position it was encoded at to that one."""
    rotary = Rotary(inv_freq=1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), rotary_dim=D)
    raw = torch.randn(1, 1, 6, D)
    encoded_at = torch.tensor([[[1, 4, 6, 9, 12, 15]]])
    keys = raw.clone()
    rotate_keys(keys, encoded_at, rotary)
    store = ColdStore(1, 1, D, D, 2, torch.float32, cold_dtype=EXACT)
    store.append(keys, keys.clone(), torch.arange(6).view(1, 1, 6), encoded_at)
    hot_before = torch.tensor([[[0, 5, 10, 11, 16, -1]]])  # hot tokens' positions before; re-numbered 0..4
    store.renumber(Renumbering.of(1, [(hot_before, hot_before >= 0)], span=100))
    want = [sum(1 for p in hot_before.flatten().tolist() if 0 <= p < q) for q in encoded_at.flatten().tolist()]
    got_keys, _, _, positions = store.pages(torch.arange(3).view(1, 1, 3), rotary)
    assert positions.flatten().tolist() == want == [1, 1, 2, 2, 4, 4]
    expected = raw.clone()
    rotate_keys(expected, torch.tensor([want]).view(1, 1, 6), rotary)
    torch.testing.assert_close(got_keys, expected, atol=1e-5, rtol=1e-5)


def _reference_frames(steps, frames):
    """A slow LRU: kept pages stay, missing ones take the least recently used free frame in turn."""
    table, used, plans = [-1] * frames, [0] * frames, []
    for clock, wanted in enumerate(steps, start=1):
        wanted = [p for p in wanted if p >= 0]
        kept = {f for f in range(frames) if table[f] in wanted}
        for f in kept:
            used[f] = clock
        free = sorted((f for f in range(frames) if f not in kept), key=lambda f: (used[f], f))
        load = [False] * frames
        for page in (p for p in wanted if p not in table):
            f = free.pop(0)
            table[f], used[f], load[f] = page, clock, True
        plans.append((list(table), load))
    return plans


@pytest.mark.parametrize("frames,want", [(4, 4), (6, 3), (3, 1)])
def test_recall_frames_follow_a_slow_lru(seed, frames, want):
    rng = random.Random(seed)
    steps = []
    for _ in range(30):  # pages drawn from a small pool so that some stay wanted across steps
        pages = rng.sample(range(8), want)
        if rng.random() < 0.2:
            pages[-1] = -1  # fewer pages than wanted (a store holding few)
        steps.append(pages)
    lru = RecallFrames(1, 1, frames)
    copied = 0
    for (table, load), wanted in zip(_reference_frames(steps, frames), steps):
        plan = lru.update(torch.tensor(wanted).view(1, 1, -1))
        assert plan.frame_page.flatten().tolist() == table
        assert plan.load.flatten().tolist() == load
        copied += sum(load)
    assert int(lru.copied.sum()) == copied


@pytest.mark.parametrize("bits,rotate", [(None, False), (4, False), (2, False), (3, True)])
@pytest.mark.parametrize("limit", [None, 8])
def test_device_digest_picks_the_pages_a_slow_loop_over_the_store_picks(seed, bits, rotate, limit):
    """KeyCodes (appended from the evicted keys on the device) against scoring every page the cold
    store holds, one by one, from its own copy of the keys (quantised as the digest stores them:
    fp16 scale and offset, after the rotation with ``rotate``)."""
    from h2ochat.recall.digests import KeyCodes
    from h2ochat.recall.selectors import dequantize, quantize, rotated

    page = 4
    store = ColdStore(B, H, D, D, page, torch.float32, limit=limit, initial_pages=1, cold_dtype=EXACT)
    digest = KeyCodes(B, H, D, page, bits, frames=store.frames, initial_pages=1, rotate=rotate)
    for event in _evictions(14, random.Random(seed)):
        store.append(*event)
        digest.append(event[0], event[2])
    queries = torch.randn(B, H, 3, D, generator=torch.Generator().manual_seed(seed))
    first, end = store.held()
    got = digest.top_pages(queries, 2)
    for b in range(B):
        for h in range(H):
            scored = []
            for number in range(int(first[b, h]), int(end[b, h])):
                keys, _, token_index, _ = store.pages(torch.full((B, H, 1), number))
                keys = keys[b, h][token_index[b, h] >= 0]
                q = rotated(queries[b, h]) if rotate else queries[b, h]
                if bits is not None:
                    keys = dequantize(*quantize(rotated(keys) if rotate else keys, bits, torch.float16))
                scored.append((float((q @ keys.T).max()), number))
            want = [n for _, n in sorted(scored, reverse=True)[:2]]
            want += [-1] * (2 - len(want))
            assert got[b, h].tolist() == want
    assert bool((digest.valid.sum(-1) == store.held_tokens()).all())


@pytest.mark.parametrize("host_reads_plan", [True, False])
def test_recall_slots_hold_the_pages_their_frames_name(seed, host_reads_plan, monkeypatch):
    """After steps of changing wishes, every frame's slots hold exactly its page's tokens as the
    cold store gives them back; frames that kept their page were not rewritten. Both routes: the
    eager CPU one copying the loaded frames only, and the one with no host read (a GPU, a graph)."""
    from h2ochat.recall import step
    from h2ochat.recall.step import RecallSlots, fill_recall_slots

    monkeypatch.setattr(step, "host_reads_allowed", lambda state: host_reads_plan)

    page, frames = 4, 3
    rng = random.Random(seed)
    store = ColdStore(B, H, D, D, page, torch.float32, cold_dtype=EXACT)
    for event in _evictions(16, rng):
        store.append(*event)
    lru = RecallFrames(B, H, frames)
    slots = RecallSlots(torch.zeros(B, H, frames * page, D), torch.zeros(B, H, frames * page, D),
                        torch.full((B, H, frames * page), -1), torch.full((B, H, frames * page), -1))
    held = int(store.held()[1].min())
    for _ in range(6):
        wanted = torch.tensor([[rng.sample(range(held), 2) for _ in range(H)] for _ in range(B)])
        before = slots.keys.clone()
        plan = lru.update(wanted)
        fill_recall_slots(slots, store, plan)
        keys, values, token_index, positions = store.pages(plan.frame_page)
        assert torch.equal(slots.token_index, token_index) and torch.equal(slots.positions, positions)
        assert torch.equal(slots.keys, keys) and torch.equal(slots.values, values)
        untouched = ~plan.load.repeat_interleave(page, dim=-1)
        assert torch.equal(slots.keys[untouched], before[untouched])


@pytest.mark.parametrize("limit", [None, 8])
def test_digest_rebuilt_after_a_renumbering_is_the_digest_of_the_moved_keys(seed, limit):
    """Cold store and exact digest (a ring under a limit) re-numbered: the rebuilt digest equals one
    appended from the start with every key already rotated to its token's new position."""
    from h2ochat.recall.digests import KeyCodes

    rotary = Rotary(inv_freq=1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), rotary_dim=D)
    events = list(_evictions(12, random.Random(seed)))
    store = ColdStore(B, H, D, D, 4, torch.float32, limit=limit, initial_pages=1, cold_dtype=EXACT)
    digest = KeyCodes(B, H, D, 4, None, frames=store.frames, initial_pages=1)
    for keys, values, token_index, positions in events:
        store.append(keys, values, token_index, positions)
        digest.append(keys, token_index)
    hot = torch.randint(0, 80, (B, H, 5), generator=torch.Generator().manual_seed(seed))  # held elsewhere
    renumbering = Renumbering.of(B, [(hot, hot >= 0)], span=100)
    store.renumber(renumbering)
    digest.rebuild(store.keys_by_slot(rotary))
    want = KeyCodes(B, H, D, 4, None, frames=store.frames, initial_pages=1)
    for keys, _, token_index, positions in events:
        moved = keys.clone()
        valid = token_index >= 0
        rotate_keys(moved, (renumbering.apply(positions, valid) - positions).masked_fill(~valid, 0), rotary)
        want.append(moved, token_index)
    assert torch.equal(digest.number, want.number)
    held = digest.valid.unsqueeze(-1)
    slots = slice(0, digest.capacity)  # (not the spill slot)
    torch.testing.assert_close(digest.codes[:, :, slots] * held, want.codes[:, :, slots] * held, atol=1e-5, rtol=1e-5)


def _slow_slot_numbers(events, slots, ring):
    """Per (sequence, head): the slot number each store slot last received (-1: none), appending
    each valid entry at count (mod the ring)."""
    held = [[[-1] * slots for _ in range(H)] for _ in range(B)]
    count = [[0] * H for _ in range(B)]
    for token_index in events:
        for b in range(B):
            for h in range(H):
                for e in range(token_index.shape[2]):
                    if token_index[b, h, e] >= 0:
                        n = count[b][h]
                        held[b][h][n % ring if ring else n] = n
                        count[b][h] += 1
    return torch.tensor(held)


@pytest.mark.parametrize("frames", [None, 2, 3])
def test_derived_slot_numbers_are_what_a_stored_number_would_hold(seed, frames):
    """``number`` (computed from the count) against a slow model of the slot numbers the digest used
    to store, over random valid/invalid patterns; a row reset as ``H2OLayer.reset_row (the recall tier's state too)`` does
    (every state tensor 0, so the count) holds nothing, then fills again from slot 0."""
    from h2ochat.recall.digests import KeyCodes

    page = 2
    rng = random.Random(seed)
    digest = KeyCodes(B, H, D, page, 2, frames=frames, initial_pages=1)
    assert "number" not in digest.state_tensors()
    events = [token_index for _, _, token_index, _ in _evictions(10, rng)]
    for token_index in events:
        digest.append(torch.randn(B, H, token_index.shape[2], D), token_index)
    ring = frames * page if frames is not None else None
    slots = digest.number.shape[2]
    assert torch.equal(digest.number, _slow_slot_numbers(events, slots, ring))
    for tensor in digest.state_tensors().values():
        tensor[0] = 0
    later = [token_index for _, _, token_index, _ in _evictions(3, rng)]
    for token_index in later:
        digest.append(torch.randn(B, H, token_index.shape[2], D), token_index)
    want = _slow_slot_numbers(events + later, digest.number.shape[2], ring)
    want[0] = _slow_slot_numbers(later, digest.number.shape[2], ring)[0]
    assert torch.equal(digest.number, want)


def _separated_pages(generator, pages, page):
    """Keys whose pages score far apart for queries along one direction: page p's keys are noise plus
    a_p times that direction (a_p distinct, 3 apart), with an outlier channel the rotation spreads."""
    direction = torch.randn(D, generator=generator)
    direction /= direction.norm()
    strength = torch.randperm(pages, generator=generator).float() * 3
    keys = 0.1 * torch.randn(B, H, pages * page, D, generator=generator)
    keys += strength.repeat_interleave(page).view(1, 1, -1, 1) * direction
    keys[..., 1] += 8.0  # an outlier channel: sets every token's range without the rotation
    queries = direction + 0.05 * torch.randn(B, H, 2, D, generator=generator)
    return keys, queries


def test_rotated_int8_digest_picks_the_exact_top_pages_and_scores_q_dot_k(seed):
    from h2ochat.recall.digests import KeyCodes
    from h2ochat.recall.selectors import rotated

    g = torch.Generator().manual_seed(seed)
    page, pages = 4, 6
    keys, queries = _separated_pages(g, pages, page)
    index = torch.arange(pages * page).expand(B, H, -1)
    exact = KeyCodes(B, H, D, page, None, initial_pages=pages)
    turned = KeyCodes(B, H, D, page, 8, initial_pages=pages, rotate=True)
    for digest in (exact, turned):
        digest.append(keys, index)
    assert torch.equal(turned.top_pages(queries, 3), exact.top_pages(queries, 3))
    # each page's score is its best q.k within the quantisation error: a code is off by at most
    # half a step, |q R . error| <= |q R|_1 * scale / 2 (plus the fp16 offset's own rounding)
    slots = slice(0, turned.capacity)  # (not the spill slot)
    step = turned.scale[:, :, slots].float() / 2 + turned.offset[:, :, slots].float().abs() * 2.0**-11
    bound = (rotated(queries).abs().sum(-1, keepdim=True) * step.unsqueeze(2)).amax(dim=2)  # [B, H, T]
    bound = bound.view(B, H, pages, page).amax(dim=-1)
    got, want = turned.scores(queries), exact.scores(queries)
    assert bool(((got - want).abs() <= bound + 1e-4).all())
    assert not torch.equal(got, want)  # (the codes are not the keys)


@pytest.mark.parametrize("limit", [None, 8])
def test_scoring_up_to_a_bound_is_the_leading_part_of_the_full_scores(seed, limit):
    from h2ochat.recall.digests import KeyCodes

    page = 4
    store = ColdStore(B, H, D, D, page, torch.float32, limit=limit, initial_pages=1, cold_dtype=EXACT)
    digest = KeyCodes(B, H, D, page, 4, frames=store.frames, initial_pages=1)
    for keys, _, token_index, _ in _evictions(9, random.Random(seed)):
        digest.append(keys, token_index)
    queries = torch.randn(B, H, 3, D, generator=torch.Generator().manual_seed(seed))
    full, slots = digest.scores(queries), digest.codes.shape[2]
    in_use = int(digest.count.max())
    for upto in (1, page, in_use, in_use + 1, slots, 10 * slots):
        frames = min(-(-upto // page), slots // page)
        got = digest.scores(queries, upto)
        assert got.shape == (B, H, frames) and torch.equal(got, full[..., :frames])
        assert torch.equal(digest.page_numbers(upto), digest.page_numbers()[..., :frames])
    for upto in (in_use, slots):  # every slot in use is scored: the same pages as scoring all
        assert torch.equal(digest.top_pages(queries, 2, upto), digest.top_pages(queries, 2))


@pytest.mark.parametrize("bits", [None, 1, 2, 3, 4, 6, 8])
def test_digest_bytes_are_the_packed_layout(bits):
    from h2ochat.recall.digests import KeyCodes

    dim, page, pages = 64, 4, 3
    digest = KeyCodes(B, H, dim, page, bits, initial_pages=pages, dtype=torch.float16)
    per_token = 2 * dim if bits is None else -(-dim // (8 // bits)) + 4  # packed codes, fp16 scale and offset
    assert digest.nbytes() == B * H * ((pages * page + 1) * per_token + 8)  # + the spill slot, and an int64 count
    digest.reserve(5 * page)  # (grown: still the formula, over the slots allocated)
    assert digest.nbytes() == B * H * (digest.codes.shape[2] * per_token + 8)


@pytest.mark.parametrize("cold_dtype", ["model", "int8-values", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_bytes_grow_by_pages_with_the_evicted_tokens(seed, dtype, cold_dtype):
    """Host bytes held are the evicted tokens' (keys and values at the model's dtype, or int8 codes
    and an fp32 scale each; token index, position and encoded position as int64) rounded up to one
    page per (sequence, head) plus the spill slot: growing by pages, not by doubling (issue 34)."""
    page = 4
    store = ColdStore(B, H, D, D, page, dtype, cold_dtype=cold_dtype)
    key = D * dtype.itemsize if cold_dtype != "int8" else D + 4  # (int8 codes and an fp32 scale)
    value = D * dtype.itemsize if cold_dtype == "model" else D + 4
    kv = key + value
    per_token = kv + 3 * 8
    appended = torch.zeros(B, H, dtype=torch.long)
    for keys, values, token_index, positions in _evictions(40, random.Random(seed)):
        store.append(keys.to(dtype), values.to(dtype), token_index, positions)
        appended += (token_index >= 0).sum(-1)
        longest = int(appended.max())  # one tensor per buffer: every (sequence, head) sized by the longest
        assert store.nbytes() <= B * H * ((-(-longest // page)) * page + 1) * per_token
    assert longest > 8 * page  # past several doublings of the first page


def test_a_store_gives_back_room_only_past_a_quarter_of_its_slots(seed):
    """``fit`` (a server's longest row reset): room is given back in whole pages when what the rows still
    hold needs at most 3/4 of the slots, and kept otherwise (a chat nearly as long grows it back soon);
    the tokens held are kept either way."""
    page = 4
    store = ColdStore(B, H, D, D, page, torch.float32, cold_dtype=EXACT)
    store.reserve(64)
    capacity = store.capacity
    keys, values = torch.randn(B, H, 5, D), torch.randn(B, H, 5, D)
    index = torch.arange(5).expand(B, H, 5).contiguous()
    store.append(keys, values, index, index.clone())
    held = store.keys[:, :, :5].clone()
    store.fit(capacity * 3 // 4 + 1)  # (needs more than 3/4: kept)
    assert store.capacity == capacity
    store.fit(capacity * 3 // 4)  # (3/4 exactly: given back, to whole pages)
    assert store.capacity == -(-capacity * 3 // 4 // page) * page < capacity
    store.fit(5)
    assert store.capacity == 2 * page and torch.equal(store.keys[:, :, :5], held)
    assert torch.equal(store.count, torch.full((B, H), 5))
