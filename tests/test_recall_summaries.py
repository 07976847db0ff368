"""The two-stage selector (recall/two_stage.py) against slow statements: with every page a candidate
it picks what the one-stage digest picks; a summary is the mean of its pages' dequantised turned keys;
at the cap the summaries coarsen (never drop a page) and the device bytes stay those of the cap."""

from __future__ import annotations

import pytest
import torch

import h2ochat_kernels as kernels
from h2ochat.recall.digests import KeyCodes
from h2ochat.recall.two_stage import TwoStageCodes
from h2ochat.recall.selectors import packed_quantize

B, H, D, P = 2, 3, 16, 4


def _pair(bits, frames=None, cap=64, candidates=64, rotate=True):
    one = KeyCodes(B, H, D, P, bits, frames=frames, rotate=rotate)
    two = TwoStageCodes(B, H, D, P, bits, frames=frames, rotate=rotate, cap=cap, candidates=candidates)
    two.tokens.rotation = one.rotation  # (the same fixed rotation: it is seeded, but say so)
    return one, two


def _append(stores, generator, n, invalid=0.2):
    keys = torch.randn(B, H, n, D, generator=generator)
    index = torch.arange(n).expand(B, H, n).clone()
    index[torch.rand(B, H, n, generator=generator) < invalid] = -1
    for store in stores:
        store.reserve(int(store.count.max()) + n)
        store.append(keys, index, reserve=False)


@pytest.mark.parametrize("bits,frames", [(4, None), (2, None), (4, 6)])
def test_with_every_page_a_candidate_the_choice_is_the_one_stage_digests(seed, bits, frames):
    generator = torch.Generator().manual_seed(seed)
    one, two = _pair(bits, frames)
    for n in (5, 1, 1, 4, 9, 1, 3):
        _append((one, two), generator, n)
        queries = torch.randn(B, H, 3, D, generator=generator)
        assert torch.equal(two.top_pages(queries, 3), one.top_pages(queries, 3))
    torch.testing.assert_close(two.tokens.codes, one.codes)


def _slow_summary(store: KeyCodes, pages: list[int], b: int, h: int) -> torch.Tensor:
    """The mean of the held tokens' dequantised (turned) keys of absolute ``pages``."""
    count = int(store.count[b, h])
    first = max(0, -(-count // P) - store.frames) * P if store.frames else 0
    rows = []
    for page in pages:
        for token in range(page * P, page * P + P):
            if first <= token < count:
                slot = token % store.capacity if store.frames else token
                code = kernels.unpack_codes(store.codes[b, h, slot], store.bits, D).float()
                rows.append(code * store.scale[b, h, slot].float() + store.offset[b, h, slot].float())
    return torch.stack(rows).mean(0)


@pytest.mark.parametrize("frames", [None, 12])
def test_summaries_are_the_mean_of_their_pages_and_coarsen_at_the_cap(seed, frames):
    generator = torch.Generator().manual_seed(seed)
    _, two = _pair(4, frames, cap=4, candidates=4)
    bytes_before = two.nbytes()
    for n in (7, 4, 4, 13, 4, 4, 4, 21):
        _append((two,), generator, n, invalid=0.0)
    assert two.pages_per_entry > 1 and two.coarsenings >= 1 and two.nbytes() == bytes_before
    g = two.pages_per_entry
    entries = two._entry_ids()
    held = two._entry_held(entries)
    for b in range(B):
        for h in range(H):
            for slot in range(two.cap):
                if not held[b, h, slot]:
                    continue
                number = int(entries[b, h, slot])
                want = _slow_summary(two.tokens, list(range(number * g, number * g + g)), b, h)
                codes, scale, offset = packed_quantize(want.view(1, -1), 4)
                assert torch.equal(two.codes[b, h, slot], codes[0]), (b, h, slot)
                assert torch.equal(two.scale[b, h, slot], scale[0]) and torch.equal(two.offset[b, h, slot], offset[0])
    # every held page is still reachable: some held summary covers it
    first = (-(-two.tokens.count // P) - (frames // P if frames else 10**9)).clamp(min=0)
    last = (two.tokens.count - 1) // P
    covered = set()
    for b in range(B):
        for h in range(H):
            numbers = entries[b, h][held[b, h]].tolist()
            pages = {number * g + i for number in numbers for i in range(g)}
            assert set(range(int(first[b, h]), int(last[b, h]) + 1)) <= pages
            covered |= pages
    assert covered


def test_the_second_stage_scores_only_the_candidates_and_takes_their_best(seed):
    """Few candidates: the pages picked are the best (one-stage score) among the summaries' top picks."""
    generator = torch.Generator().manual_seed(seed)
    one, two = _pair(4, None, cap=64, candidates=2)
    _append((one, two), generator, 40, invalid=0.0)
    queries = torch.randn(B, H, 2, D, generator=generator)
    scores = one.scores(queries)  # [B, H, pages] the one-stage digest's page scores
    entries = two._entry_ids()
    summary = (torch.einsum("bhmd,bhed->bhme", two.tokens.turned(queries).float(),
                            kernels.unpack_codes(two.codes[:, :, :64], 4, D).float() * two.scale[:, :, :64, None].float()
                            + two.offset[:, :, :64, None].float()).amax(2))
    summary = summary.masked_fill(~two._entry_held(entries), float("-inf"))
    picked = two.top_pages(queries, 1)
    for b in range(B):
        for h in range(H):
            candidates = entries[b, h, summary[b, h].topk(2).indices]
            best = candidates[scores[b, h, candidates].argmax()]
            assert int(picked[b, h, 0]) == int(best)


def test_rows_appending_on_their_own_clocks_do_not_coarsen_and_a_reset_row_makes_them_finer(seed):
    """Issue 34: the rows of a server flush their pages at other steps (one append per row, the others
    appending nothing): the cap counts the longest row's pages, not the appends; once that row is
    emptied the summaries are as fine as the rows left need."""
    generator = torch.Generator().manual_seed(seed)
    _, two = _pair(4, None, cap=4, candidates=4)
    for turn in range(12):  # each row in turn appends a page: 6 pages each, over the cap of 4 in all 12
        row = turn % B
        keys = torch.randn(B, H, P, D, generator=generator)
        index = torch.arange(P).expand(B, H, P).clone()
        index[[r for r in range(B) if r != row]] = -1
        two.reserve(int(two.count.max()) + P)
        two.append(keys, index, reserve=False)
        assert two.pages_per_entry == (1 if turn // B + 1 <= two.cap else 2), turn
    assert two.pages_per_entry == 2 and int(two.count.max()) == 6 * P
    # row 0 is emptied (a server's reset: every state tensor at its empty value), row 1 appends again
    for name, tensor in two.state_tensors().items():
        tensor[0] = -1 if name in ("token_index",) else 0
    keys = torch.randn(B, H, 1, D, generator=generator)
    index = torch.tensor([-1, 0]).view(B, 1, 1).expand(B, H, 1).clone()
    two.append(keys, index)
    assert int(two.count[0].max()) == 0 and two.pages_per_entry == 2  # (row 1: 6 pages and a token)
    for name, tensor in two.state_tensors().items():
        tensor[1] = -1 if name in ("token_index",) else 0
    two.append(keys, index)
    assert two.pages_per_entry == 1


@pytest.mark.parametrize("short_pages", [1, 3, 4, 6, 12])
def test_a_row_chooses_as_alone_beside_a_row_that_coarsened(seed, short_pages):
    """Each row's summaries coarsen by its own count (issue 34: a served chat's tokens do not depend on
    the other chats), so a row chooses the pages it would alone, however long the row beside it grew:
    one holding no more pages than the candidates (here 4: every page scored), and one holding more
    (6 or 12 pages: 2 or 4 pages a summary, stage 1 prunes) beside a row of 40 (16 pages a summary)."""
    generator = torch.Generator().manual_seed(seed)
    batch = TwoStageCodes(2, H, D, P, 4, rotate=True, cap=4, candidates=4)
    alone = TwoStageCodes(1, H, D, P, 4, rotate=True, cap=4, candidates=4)
    alone.tokens.rotation = batch.tokens.rotation
    short = torch.randn(1, H, short_pages * P, D, generator=generator)
    chunk_tokens = 4 * P
    for chunk in range(10):  # row 0 grows to 40 pages (coarsened to 16 pages a summary), row 1 stays short
        keys = torch.randn(2, H, chunk_tokens, D, generator=generator)
        index = torch.arange(chunk * chunk_tokens, (chunk + 1) * chunk_tokens).expand(2, H, chunk_tokens).clone()
        part = short[0, :, chunk * chunk_tokens:(chunk + 1) * chunk_tokens]  # row 1's share of this chunk
        keys[1, :, :part.shape[1]] = part
        index[1, :, part.shape[1]:] = -1
        batch.reserve(int(batch.count.max()) + chunk_tokens)
        batch.append(keys, index, reserve=False)
        if part.shape[1]:  # (the same appends alone)
            alone.reserve(int(alone.count.max()) + part.shape[1])
            alone.append(part.unsqueeze(0), index[1:, :, :part.shape[1]].clone(), reserve=False)
    alone_scale = 1
    while -(-short_pages // alone_scale) > 4:  # (the cap: the fewest pages a summary, a power of two)
        alone_scale *= 2
    assert batch.pages_per_entry == 16 and alone.pages_per_entry == alone_scale
    for _ in range(5):
        queries = torch.randn(2, H, 3, D, generator=generator)
        beside = batch.top_pages(queries, 2)[1]
        own = alone.top_pages(queries[1:], 2)[0]
        for h in range(H):  # the same pages (the widths differ: "none" pads a row with fewer)
            assert set(beside[h].tolist()) - {-1} == set(own[h].tolist()) - {-1}, h
