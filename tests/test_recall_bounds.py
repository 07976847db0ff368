"""PageBounds (Quest's min/max per page on the device) against a slow, obvious reference: Python lists
of every key appended per (sequence, head), cut into pages by loops."""

from __future__ import annotations

import random

import pytest
import torch

from h2ochat.recall.bounds import PageBounds

B, H, D = 2, 3, 8
CASES = [(4, None), (4, 2), (3, 1), (1, 3)]  # (page, ring frames): a page of one; a one-page ring


def _chunks(steps: int, rng: random.Random, dtype=torch.float32):
    """Random appends: E of 1-7 entries, each valid with a probability of its own (per row and head,
    so counts differ; some entries of every kind of row evict nothing)."""
    for _ in range(steps):
        width = rng.randint(1, 7)
        odds = [[rng.choice([0.0, 0.5, 0.9]) for _ in range(H)] for _ in range(B)]
        valid = torch.tensor([[[rng.random() < odds[b][h] for _ in range(width)] for h in range(H)] for b in range(B)])
        token_index = torch.where(valid, torch.arange(width), -1)  # only the sign matters to the digest
        yield torch.randn(B, H, width, D).to(dtype), token_index


class Reference:
    """Every appended key per (sequence, head), in order; pages and bounds by loops."""

    def __init__(self, page: int, frames: int | None):
        self.page, self.frames = page, frames
        self.keys = [[[] for _ in range(H)] for _ in range(B)]

    def append(self, keys, token_index):
        for b in range(B):
            for h in range(H):
                for e in range(keys.shape[2]):
                    if token_index[b, h, e] >= 0:
                        self.keys[b][h].append(keys[b, h, e].float())

    def held(self, b, h) -> dict[int, torch.Tensor]:
        """Frame -> (page number, its keys) for every page still held."""
        keys, page = self.keys[b][h], self.page
        end = -(-len(keys) // page)
        first = max(end - self.frames, 0) if self.frames is not None else 0
        return {(p % self.frames if self.frames else p): (p, torch.stack(keys[p * page:(p + 1) * page]))
                for p in range(first, end)}

    def bound(self, queries, keys) -> float:
        """Quest's bound for one page, the obvious way: per query and channel the larger end of the box."""
        low, high = keys.amin(0), keys.amax(0)
        return max(float(torch.maximum(q * low, q * high).sum()) for q in queries.float())


def _check(digest: PageBounds, ref: Reference, queries: torch.Tensor):
    numbers, scores = digest.page_numbers(), digest.scores(queries)
    frames = digest.low.shape[2] - 1
    assert numbers.shape == scores.shape == (B, H, frames)
    top = digest.top_pages(queries, 3)
    k = top.shape[-1]
    assert k == min(3, frames)  # fewer only where fewer frames exist
    for b in range(B):
        for h in range(H):
            assert int(digest.count[b, h]) == len(ref.keys[b][h])
            held = ref.held(b, h)
            expected = {}
            for f in range(frames):
                if f not in held:
                    assert numbers[b, h, f] == -1 and scores[b, h, f] == float("-inf")
                    continue
                page, keys = held[f]
                assert numbers[b, h, f] == page
                # min and max are exact (no rounding): every channel, only this page's tokens
                assert torch.equal(digest.low[b, h, f].float(), keys.amin(0))
                assert torch.equal(digest.high[b, h, f].float(), keys.amax(0))
                expected[page] = ref.bound(queries[b, h], keys)
                torch.testing.assert_close(float(scores[b, h, f]), expected[page], rtol=1e-5, atol=1e-5)
                # Quest's guarantee: no key of the page reaches past its bound
                assert float((queries[b, h].float() @ keys.T).max()) <= float(scores[b, h, f]) + 1e-4
            got = [int(p) for p in top[b, h]]
            chosen = [p for p in got if p >= 0]
            best = sorted(expected.values(), reverse=True)[:k]
            assert got == chosen + [-1] * (k - len(chosen)) and len(set(chosen)) == len(chosen) == len(best)
            torch.testing.assert_close([expected[p] for p in chosen], best, rtol=1e-5, atol=1e-5)


def _filled(seed, page, frames, steps=14, **kwargs):
    rng = random.Random(seed)
    digest = PageBounds(B, H, D, page, frames=frames, **kwargs)
    ref = Reference(page, frames)
    for keys, token_index in _chunks(steps, rng, digest.low.dtype):
        digest.append(keys, token_index)
        ref.append(keys, token_index)
    return digest, ref


@pytest.mark.parametrize("page, frames", CASES)
def test_bounds_scores_and_top_pages_equal_a_loop_over_the_appended_keys(seed, page, frames):
    rng = random.Random(seed)
    digest = PageBounds(B, H, D, page, frames=frames, initial_pages=1)
    ref = Reference(page, frames)
    for keys, token_index in _chunks(16, rng):
        digest.append(keys, token_index)
        ref.append(keys, token_index)
        _check(digest, ref, torch.randn(B, H, rng.randint(1, 4), D))  # after every append: pages still filling
    if frames is None:
        assert digest.low.shape[2] - 1 >= -(-int(digest.count.max()) // page)  # grew as needed
    else:
        assert digest.low.shape[2] == frames + 1  # a ring never grows


def test_fp16_bounds_are_the_keys_own_values_and_bytes_are_two_per_channel_and_page(seed):
    digest, ref = _filled(seed, 4, 2, dtype=torch.float16)
    _check(digest, ref, torch.randn(B, H, 2, D))
    frames = 2 + 1  # the spill frame too
    assert digest.nbytes() == 2 * B * H * frames * D * 2 + B * H * 8
    state = digest.state_tensors()
    assert set(state) == {"low", "high", "count"} and all(t.shape[0] == B for t in state.values())


def test_a_ring_frame_reused_by_a_newer_page_holds_only_the_new_pages_bounds():
    page, frames = 4, 2
    digest = PageBounds(1, 1, D, page, frames=frames)
    everywhere = torch.zeros(1, 1, 2 * page, dtype=torch.long)
    digest.append(torch.full((1, 1, 2 * page, D), 50.0), everywhere)  # pages 0 and 1, far from what follows
    key = torch.randn(1, 1, 1, D)
    digest.append(key, torch.zeros(1, 1, 1, dtype=torch.long))  # page 2's first token takes frame 0
    assert digest.page_numbers().tolist() == [[[2, 1]]]
    assert torch.equal(digest.low[0, 0, 0], key[0, 0, 0]) and torch.equal(digest.high[0, 0, 0], key[0, 0, 0])
    # one append longer than the ring: only the pages still held after it reach their frames
    digest = PageBounds(1, 1, D, page, frames=1)
    keys = torch.cat([torch.full((1, 1, page, D), 50.0), torch.randn(1, 1, 3, D)], dim=2)
    digest.append(keys, torch.zeros(1, 1, page + 3, dtype=torch.long))
    assert digest.page_numbers().tolist() == [[[1]]]
    assert torch.equal(digest.low[0, 0, 0], keys[0, 0, page:].amin(0))
    assert torch.equal(digest.high[0, 0, 0], keys[0, 0, page:].amax(0))


@pytest.mark.parametrize("page, frames", CASES)
def test_rebuild_equals_appending_the_keys_by_slot_afresh(seed, page, frames):
    digest, _ = _filled(seed, page, frames)
    count = digest.count
    slots = frames * page if frames is not None else -(-int(count.max()) // page) * page + page
    keys_by_slot = torch.randn(B, H, slots, D)  # the cold keys at their new positions
    digest.rebuild(keys_by_slot)
    # afresh: token n of every row and head (n < its count) with the key its slot holds, in one append
    n = torch.arange(int(count.max()))
    fresh = PageBounds(B, H, D, page, frames=frames)
    ref = Reference(page, frames)
    keys = keys_by_slot[:, :, n % slots]
    token_index = torch.where(n < count.unsqueeze(-1), n, -1)
    fresh.append(keys, token_index)
    ref.append(keys, token_index)
    queries = torch.randn(B, H, 3, D)
    _check(digest, ref, queries)
    _check(fresh, ref, queries)


def test_reserve_grows_without_losing_anything_and_a_reset_row_starts_clean(seed):
    digest, ref = _filled(seed, 4, None, initial_pages=1)
    before = digest.low.shape[2] - 1
    digest.reserve(4 * 4 * before)  # 4 times the pages (of 4 tokens): doubles twice
    assert digest.low.shape[2] - 1 == 4 * before
    assert digest.state_tensors()["low"] is digest.low  # the state is the grown buffers
    _check(digest, ref, torch.randn(B, H, 2, D))
    # a row reset writes zeros (H2OLayer.reset_row (the recall tier's state too)); the next page's first token resets its frame
    for tensor in digest.state_tensors().values():
        tensor[1] = 0
    ref.keys[1] = [[] for _ in range(H)]
    for keys, token_index in _chunks(5, random.Random(seed + 1)):
        digest.append(keys, token_index)
        ref.append(keys, token_index)
    _check(digest, ref, torch.randn(B, H, 2, D))
    ring = PageBounds(B, H, D, 4, frames=2)
    ring.reserve(1000)
    assert ring.low.shape[2] == 3


@pytest.mark.parametrize("frames", [None, 2])
def test_scores_upto_score_the_leading_frames(seed, frames):
    digest, _ = _filled(seed, 4, frames, initial_pages=8)
    queries = torch.randn(B, H, 2, D)
    upto = int(digest.count.max())
    leading = min(-(-upto // 4), digest.low.shape[2] - 1)
    assert torch.equal(digest.scores(queries, upto), digest.scores(queries)[:, :, :leading])
    assert torch.equal(digest.page_numbers(upto), digest.page_numbers()[:, :, :leading])


@pytest.mark.parametrize("frames", [None, 2])
def test_append_after_reserve_reads_nothing_back(seed, monkeypatch, frames):
    """A compiled decode step holds the append: no host read once room is reserved."""
    digest, ref = _filled(seed, 4, frames, initial_pages=1)
    chunks = list(_chunks(4, random.Random(seed + 1)))
    digest.reserve(int(digest.count.max()) + sum(c[1].shape[2] for c in chunks))

    def read(*_):
        raise AssertionError("host read")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, read)
    with pytest.raises(AssertionError, match="host read"):  # the patch bites: reserving reads the count
        digest.append(*chunks[0])
    for keys, token_index in chunks:
        digest.append(keys, token_index, reserve=False)
    monkeypatch.undo()
    for keys, token_index in chunks:
        ref.append(keys, token_index)
    _check(digest, ref, torch.randn(B, H, 2, D))
