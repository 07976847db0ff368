"""Whether an exact choice of pages could skip scoring most cold pages (issue 34, the cost of recall).

The decode step's exact choice scores every cold key with the step's queries and keeps the pages with the best
q.k. A branch-and-bound choice would first bound each page's best q.k from a summary of its keys, then score
exactly only the pages whose bound reaches the k-th best exact score found: the same pages, less work, if the
bounds are tight. This measures how many pages such a choice would still score, on the shipped tier's own
decode choices (pass-key trials on real text, recall at the default split and page), for two bounds:

- ``box``: Quest's, per page and channel the keys' min and max, sum_c max(q_c low_c, q_c high_c);
- ``ball``: the page's mean key c and radius r (the largest |k - c|), q.c + |q| r;

and the smaller of the two. A page's score is its best over the step's queries (a group's), as the choice's.

    python benchmarks/heldout_texts.py /tmp/heldout
    python benchmarks/recall_bound_pruning.py --text /tmp/heldout/gpl3.txt,/tmp/heldout/bash_man.txt \
        --lengths 2000 --budget 128 --out benchmarks/results_recall_bound_pruning_s67.json
"""

from __future__ import annotations

import json
import statistics

import torch

from h2ochat.recall.tier import RecallTier
from tier_probe import probe_arguments, probe_trials  # (benchmarks/)
from json_report import write

BOUNDS = ("box", "ball", "smaller")


def page_bounds(queries: torch.Tensor, pages: torch.Tensor) -> dict[str, torch.Tensor]:
    """Upper bounds [B, H, N] of each page's best q.k over the queries [B, H, G, D], pages [B, H, N, P, D]."""
    low, high = pages.amin(3), pages.amax(3)
    box = torch.maximum(queries.unsqueeze(3) * low.unsqueeze(2), queries.unsqueeze(3) * high.unsqueeze(2)).sum(-1)
    centre = pages.mean(3)
    radius = (pages - centre.unsqueeze(3)).norm(dim=-1).amax(-1)
    ball = torch.einsum("bhgd,bhnd->bhgn", queries, centre) + queries.norm(dim=-1).unsqueeze(-1) * radius.unsqueeze(2)
    box, ball = box.amax(2), ball.amax(2)
    return {"box": box, "ball": ball, "smaller": torch.minimum(box, ball)}


class BoundTier(RecallTier):
    """The shipped tier, recording at each decode choice the share of full cold pages whose bound reaches the
    k-th best exact page score (the pages a branch-and-bound choice would still score exactly)."""

    shares: dict[str, list[float]] = {name: [] for name in BOUNDS}  # (class-wide sink)

    def recall(self, port, queries, rotary, rows=True, rest=None) -> bool:
        cold, chosen = self.cold, self.frames.frame_page.shape[-1]
        full = int(cold.count.max()) // cold.page
        if queries.shape[2] <= 8 and rows is not False and full > chosen:  # (a decode step's group)
            scored = cold.scored_queries(queries).float()  # [B, H, G, D]
            keys = cold.keys[:, :, :full * cold.page].float()
            batch, heads, _, dim = keys.shape
            pages = keys.view(batch, heads, full, cold.page, dim)
            exact = torch.einsum("bhgd,bhtd->bhgt", scored, keys).view(batch, heads, -1, full, cold.page)
            exact = exact.amax(-1).amax(2)  # [B, H, N]
            kth = exact.topk(chosen, dim=-1).values[..., -1:]
            for name, bound in page_bounds(scored, pages).items():
                if not bool((bound >= exact - 1e-3).all()):
                    raise AssertionError(f"the {name} bound fell below a page's exact score")
                BoundTier.shares[name].append(float((bound >= kth).float().mean()))
        return super().recall(port, queries, rotary, rows, rest)


def main() -> None:
    args = probe_arguments(__doc__.splitlines()[0], lengths="2000", depths="0.5", threads_default=1).parse_args()
    probed = probe_trials(args, BoundTier, "8")
    summary = {name: {"choices": len(shares), "mean": round(statistics.fmean(shares), 4),
                      "median": round(statistics.median(shares), 4),
                      "p10": round(sorted(shares)[len(shares) // 10], 4)}
               for name, shares in BoundTier.shares.items()}
    result = {"what": "share of full cold pages whose bound reaches the k-th best exact page score, per decode "
                      "choice (what a branch-and-bound exact choice would still score)",
              **probed, "args": vars(args), "bounds": summary}
    write(result, args.out)
    print(json.dumps(summary, indent=1))

if __name__ == "__main__":
    main()
