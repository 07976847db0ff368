"""``TwoStageCodes``, the coded selectors' default (intN, rotN): two-stage page selection with bounded
device memory.

Stage 1, on the device: per (sequence, KV head) at most ``cap`` summaries (allocated once: the
device bytes do not grow with the text). A summary covers g consecutive pages (g = 1 until the
cap) and holds the mean of their turned keys (the rotation of ``rotN``) as b-bit codes with an fp16
scale and offset, the digest's layout: 36 bytes at D = 64 and 4 bits, 2.25 bytes per token at
pages of 16. Its score is the best q . mean over the step's queries; the top C // g summaries name C
candidate pages.

Stage 2, where the cold store lives (pinned host memory on a GPU, the same memory on the CPU): the
token-level codes of every cold token (a ``KeyCodes``), of which only the C candidates' are
read and scored as the one-stage digest scores every page (the best q.k of each page); the best
pages go to the recall frames. With C pages or fewer held every page is a candidate, so the choice
is the one-stage digest's, and it is made as the one-stage digest makes it (the store's slots read in place).

At the cap: when the pages a row appended would need more than ``cap`` summaries, that row's g doubles
and every summary of it is made again from the token codes (coarser summaries, never dropped pages:
counted in ``coarsenings``, shown as the pages per summary in /cache, --json and the tier's stats,
the largest of any row). Each row's g follows its own count (``doublings``, a state tensor that moves
with the row when a server parks or resumes it), so a row's choice does not depend on the other rows
(on a GPU under zero-copy the counts live on the device, and the rows coarsen together by a host
bound of the longest). Summaries are made from the token codes (dequantised), when a flush or a
chunk appends tokens (the summaries those tokens touch) and after a re-numbering (all); rows of one
scale are made together, as many tokens a mean as the row alone takes.
"""

from __future__ import annotations

import torch

import h2ochat_kernels as kernels

from .digests import KeyCodes
from .layout import FirstRows, held_pages, pages_of, tensor_bytes, widened_pages
from .selectors import packed_quantize, score_pages


SUMMARY_CAP = 256  # summaries per (layer, sequence, KV head): 9 KiB at 4 bits and D = 64
CANDIDATE_TOKENS = 4096  # cold tokens whose codes stage 2 scores (256 pages of 16): the page means lose the
# pass key at 880 tokens with 16 or 32 candidate pages of 16 (benchmarks/results_recall_amortized.json), and at
# 3,600 tokens with 128 (5 of the 8 keys 128 lost were found scoring every page:
# results_recall_heldout_misses_512.jsonl), so they only prune past this; counted in tokens, so a smaller
# --page scores as many tokens (in more, smaller candidate pages)


class TwoStageCodes(FirstRows):
    """The digest contract of ``KeyCodes`` (append, reserve, rebuild, top_pages, count, nbytes) with
    the token codes in the cold store's memory and ``cap`` page summaries on the device."""

    def __init__(self, batch: int, heads: int, head_dim: int, page: int, bits: int, *, frames: int | None = None,
                 device=None, host=None, dtype=torch.float32, rotate: bool = False,
                 backend: kernels.Backend | None = None, cap: int = SUMMARY_CAP,
                 candidates: int | None = None):
        if cap < 2:
            raise ValueError(f"the summary cap must be at least 2 summaries, got {cap}")
        same = host is None or torch.device(host) == torch.device(device or "cpu")
        self.tokens = KeyCodes(batch, heads, head_dim, page, bits, frames=frames, device=host if not same else device,
                               dtype=dtype, rotate=rotate, backend=backend if same else None)
        self.page, self.bits, self.frames, self.cap = page, bits, frames, cap
        # pages whose token codes stage 2 scores (None: as many as hold CANDIDATE_TOKENS tokens)
        self.candidates = candidates if candidates is not None else max(1, CANDIDATE_TOKENS // page)
        self.head_dim, self.device, self.backend = head_dim, torch.device(device or "cpu"), backend
        width = kernels.packed_width(head_dim, bits)
        self.codes = torch.zeros(batch, heads, cap + 1, width, dtype=torch.uint8, device=device)  # + a spill row
        self.scale = torch.zeros(batch, heads, cap + 1, dtype=torch.float16, device=device)
        self.offset = torch.zeros(batch, heads, cap + 1, dtype=torch.float16, device=device)
        # each row's pages per summary, as log2 (0: one page), in host memory: a state tensor, so a row's
        # summaries travel with the scale they were made at (a parked row, a row moved), and a reset row
        # (state emptied to 0) starts again at one page
        self.doublings = torch.zeros(batch, dtype=torch.long)
        self._rows = [1] * batch  # (``_row_pages``)
        self.coarsenings = 0  # times the cap made some row's summaries coarser
        self.appended = [0] * batch  # host: per row, an upper bound of the tokens any of its heads appended
        self.reserved = 0  # host: the most tokens room was asked for (an imported row's count too)

    # -- the digest contract ----------------------------------------------------------------------
    @property
    def count(self) -> torch.Tensor:
        return self.tokens.count

    @property
    def capacity(self) -> int:
        return self.tokens.capacity

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {**self.tokens.state_tensors(), "summary_codes": self.codes, "summary_scale": self.scale,
                "summary_offset": self.offset, "summary_doublings": self.doublings}

    @property
    def pages_per_entry(self) -> int:
        """The most pages a summary of any row covers (the tier's statistics)."""
        return max(self._rows)

    def _row_pages(self) -> list[int]:
        """Each row's pages per summary (the host's copy of ``doublings``: a decode step reads nothing)."""
        return self._rows

    def keep_first_rows(self, rows: int) -> None:
        """(``layout.FirstRows``, on the copy.) The token codes and summaries cut to the first rows, and
        the host's per-row lists with them."""
        self.tokens = self.tokens.first_rows(rows)
        self.codes, self.scale, self.offset = self.codes[:rows], self.scale[:rows], self.offset[:rows]
        self.doublings, self._rows, self.appended = self.doublings[:rows], self._rows[:rows], self.appended[:rows]

    def state_written(self) -> None:
        """Rows of the state were written from outside (a row imported or reset by its cache): the host's
        copy of each row's scale is read again."""
        self._rows = [1 << d for d in self.doublings.tolist()]

    def _spans(self, device) -> torch.Tensor:
        """[B, 1]: each row's pages per summary, as a tensor on ``device``."""
        return torch.tensor(self._rows, device=device).view(-1, 1)

    def reserve(self, needed: int) -> None:
        self.reserved = max(self.reserved, needed)
        self.tokens.reserve(needed)

    def append(self, keys: torch.Tensor, token_index: torch.Tensor, *, reserve: bool = True) -> None:
        """The evicted keys [B, H, E, D] (token index -1: none), in eviction order: token codes, then
        the summaries they touch (all of them when the cap makes the summaries coarser)."""
        host = self.tokens.count.device
        before = self.tokens.count.clone()
        self.tokens.append(keys.to(host), token_index.to(host), reserve=reserve)
        # each row's longest count in host memory (rows append on their own clocks); else a bound of every
        # row's (under zero-copy the counts live on the GPU: the rows coarsen together, by the longest)
        if host.type == "cpu":
            self.appended = self.tokens.count.amax(dim=1).tolist()
        else:
            self.appended = [max(max(self.appended) + keys.shape[2], self.reserved)] * len(self.appended)
        changed = self._coarsen()
        if changed:  # those rows' summaries all again, at their new scale
            keep = torch.tensor([row not in changed for row in range(len(self.appended))], device=host)
            self._refresh(self._entry_ids().masked_fill(keep.view(-1, 1, 1), -1))
        span = self.page * self._spans(host)  # [B, 1] tokens per summary
        first = before // span  # the summary the first new token lands in, and the next ones
        touched = first.unsqueeze(-1) + torch.arange(-(-keys.shape[2] // int(span.min())) + 1, device=host)
        last = (self.tokens.count - 1) // span
        touched = touched.masked_fill(touched > last.unsqueeze(-1), -1)
        if changed:
            touched[changed] = -1  # (made whole above)
        self._refresh(touched)

    def rebuild(self, keys_by_slot: torch.Tensor) -> None:
        """After a re-numbering (RoPE): the token codes again, then every summary."""
        self.tokens.rebuild(keys_by_slot)
        self._refresh(self._entry_ids())

    def top_pages(self, queries: torch.Tensor, count: int, upto: int | None = None) -> torch.Tensor:
        """[B, H, k] absolute page numbers of the best ``count`` pages (-1 where fewer), chosen among
        the candidates the summaries name. ``upto`` is not needed: stage 1 scores the summary slots filled
        so far (at most ``cap``)."""
        host = self.tokens.count.device
        rows = self._row_pages()
        # only the summary slots some row can have filled (numbers 0..used-1 live in slots 0..used-1 until
        # the cap), from host bounds of every row's count (nothing read back): a short text scores a few
        # summaries, not the cap
        bound = max(max(self.appended), self.reserved)
        used = [min(self.cap, max(1, -(-bound // (self.page * g)))) for g in rows]
        wanted = [max(1, self.candidates // g) for g in rows]  # summaries whose pages stage 2 scores, per row
        width = min(count, max(w * g for w, g in zip(wanted, rows)))  # as wide as when every summary is scored
        if all(u <= w for u, w in zip(used, wanted)):
            # every summary is a candidate: stage 2 scores every page, the one-stage digest's choice, read
            # in place (views of the store's leading slots: no page gathered, 0.73 -> 0.49 ms a layer at 2K)
            return widened_pages(self.tokens.top_pages(queries.to(host), count, upto=bound), width).to(queries.device)
        # stage 1 for every row, each to its own number of candidates (a row whose summaries are all
        # candidates keeps them all: the choice above); the widths are the widest row's, the rest "none"
        turned = self.tokens.turned(queries.to(host))  # (the shortcut's digest turns them itself)
        entries = self._entry_ids()[:, :, :max(used)]  # [B, H, used]
        valid = self._entry_held(entries)
        stage1 = score_pages(turned.to(self.device), self.codes[:, :, :max(used)], self.scale[:, :, :max(used)],
                             self.offset[:, :, :max(used)], valid.to(self.device), 1, self.bits, backend=self.backend)
        best = kernels.top_pages(stage1, max(wanted)).to(host)  # [B, H, k] summary slots, best first
        if min(wanted) < max(wanted):  # (a coarser row takes fewer summaries, as many pages)
            rank = torch.arange(best.shape[-1], device=host)
            best = best.masked_fill(rank >= torch.tensor(wanted, device=host).view(-1, 1, 1), -1)
        # the candidates in slot order, not score order: stage 2 breaks its ties by position, which then
        # does not depend on how many summary slots stage 1 scored
        best = best.sort(dim=-1).values
        chosen = entries.gather(-1, best.clamp(min=0)).masked_fill(best < 0, -1)
        pages = pages_of(chosen, self._spans(host).view(-1, 1, 1, 1), max(rows))  # [B, H, k * g]
        stage2 = self._page_scores(turned.to(host), pages)
        pick = kernels.top_pages(stage2, count)
        chosen_pages = pages.gather(-1, pick.clamp(min=0)).masked_fill(pick < 0, -1)
        return widened_pages(chosen_pages, width).to(queries.device)

    def host_nbytes(self) -> int:
        """The token codes' bytes (the cold store's memory)."""
        return self.tokens.nbytes()

    def nbytes(self) -> int:
        """Device bytes: the summaries (fixed: ``cap`` of them and a spill row)."""
        return tensor_bytes((self.codes, self.scale, self.offset))

    # -- summaries ----------------------------------------------------------------------------------
    def _coarsen(self) -> list[int]:
        """Each row's pages per summary (a power of two) fitting the pages it appended in the cap; without
        a ring the fewest (finer again once a server resets a long row); a ring never gets finer. A row's
        scale follows its own count only, so its choice does not depend on the other rows. Returns the
        rows whose scale changed."""
        changed = []
        for row, (appended, now) in enumerate(zip(self.appended, self._row_pages())):
            pages, g = -(-appended // self.page), 1
            if self.frames is not None:
                g, pages = now, min(pages, self.frames + now)
            while -(-pages // g) > self.cap:
                g *= 2
            if g != now:
                self.coarsenings += g > now
                self.doublings[row] = g.bit_length() - 1
                self._rows[row] = g
                changed.append(row)
        return changed

    def _entry_ids(self) -> torch.Tensor:
        """[B, H, cap]: the summary number each summary slot holds now (-1: none): the latest number
        below the count's end that lives there (number mod cap)."""
        span = self.page * self._spans(self.tokens.count.device)
        last = ((self.tokens.count - 1) // span).unsqueeze(-1)
        slot = torch.arange(self.cap, device=last.device)
        number = last - (last - slot).remainder(self.cap)
        return number.masked_fill(number < 0, -1)

    def _entry_held(self, entries: torch.Tensor) -> torch.Tensor:
        """Summaries covering some held token."""
        first, _ = held_pages(self.tokens.count, self.page, self.frames)
        end_page = (entries + 1) * self._spans(entries.device).unsqueeze(-1)
        return (entries >= 0) & (end_page > first.unsqueeze(-1))

    def _tokens_of_pages(self, pages: torch.Tensor):
        """For absolute pages [B, H, K] (-1: none): each page's codes, scale, offset [B, H, K * P, ...]
        read from the token store, and which of its slots hold a token still held."""
        store = self.tokens
        first, _ = held_pages(store.count, self.page, self.frames)
        token = pages.clamp(min=0).unsqueeze(-1) * self.page + torch.arange(self.page, device=pages.device)
        held = ((pages >= 0) & (pages >= first.unsqueeze(-1))).unsqueeze(-1) & (token < store.count[..., None, None])
        # whole pages by (row, head, page) index, not a per-token index expanded over the code bytes (a
        # gather that cost more than scoring them); a slot not held is read but never counted
        stored = store.capacity // self.page  # the store grows by whole pages
        frame = pages.clamp(min=0) % stored if self.frames is not None else pages.clamp(min=0, max=stored - 1)
        row = torch.arange(pages.shape[0], device=pages.device).view(-1, 1, 1)
        head = torch.arange(pages.shape[1], device=pages.device).view(1, -1, 1)

        def take(buffer):
            return buffer[:, :, : stored * self.page].unflatten(2, (stored, self.page))[row, head, frame].flatten(2, 3)

        return take(store.codes), take(store.scale), take(store.offset), held.flatten(2)

    def _page_scores(self, turned: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """Stage 2: the best q.k of each candidate page [B, H, K] from its token codes (-inf: none)."""
        codes, scale, offset, held = self._tokens_of_pages(pages)
        return score_pages(turned, codes, scale, offset, held, self.page, self.bits, backend=self.tokens.backend)

    def _refresh(self, entries: torch.Tensor) -> None:
        """Summaries [B, H, K] (-1: leave alone) made again from the token codes of their pages, the rows
        of each scale together (a mean over as many tokens as the row alone would take: the same bits)."""
        rows = self._row_pages()
        for g in sorted(set(rows)):
            other = torch.tensor([r != g for r in rows], device=entries.device).view(-1, 1, 1)
            self._refresh_at(entries.masked_fill(other, -1) if len(set(rows)) > 1 else entries, g)

    def _refresh_at(self, entries: torch.Tensor, g: int) -> None:
        """``_refresh`` of summaries covering ``g`` pages each."""
        pages = pages_of(entries, g)
        codes, scale, offset, held = self._tokens_of_pages(pages)
        keys = (kernels.unpack_codes(codes, self.bits, self.head_dim).float() * scale.float().unsqueeze(-1)
                + offset.float().unsqueeze(-1))  # [B, H, K * g * P, D], turned
        batch, heads, k = entries.shape
        weight = held.view(batch, heads, k, g * self.page, 1).float()
        mean = (keys.view(batch, heads, k, g * self.page, -1) * weight).sum(-2) / weight.sum(-2).clamp_min(1)
        new_codes, new_scale, new_offset = packed_quantize(mean, self.bits)
        write = (entries >= 0) & held.view(batch, heads, k, -1).any(-1)
        target = entries.remainder(self.cap).masked_fill(~write, self.cap).to(self.device)  # (else the spill row)
        self.codes.scatter_(2, target.unsqueeze(-1).expand(*target.shape, self.codes.shape[-1]),
                            new_codes.to(self.device))
        self.scale.scatter_(2, target, new_scale.to(self.device))
        self.offset.scatter_(2, target, new_offset.to(self.device))
