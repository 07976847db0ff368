"""Whether a decode step could keep the last step's choice of pages (issue 34, the cost of recall).

FreeKV and ShadowKV reuse a choice across decode steps while the queries stay close. This measures
that premise on our model before building it: over pass-key trials (the context as chunks, the
question and the answer token by token, as ``eval --task passkey``'s recall rows feed them), every
decode step of every layer chooses its pages as the shipped tier does (``--recall-every 1``) and
records

- ``similarity``: the cosine similarity of the step's queries to the previous decode step's, the
  least over the layer's KV heads and query heads (what a reuse rule would compare with a threshold);
- ``loads``: the pages the step's choice brought in that the frames did not hold (summed over KV heads);
- ``wanted``: the pages it wanted (at most the frames per KV head, times the KV heads).

A step whose choice loads nothing could have kept the last one. The report gives, for thresholds of
the similarity, the share of steps a reuse rule would skip and how many pages those skipped steps'
own choices still changed (``pages changed per skipped step``): if that is near the pages changed by
the steps it keeps, the similarity does not tell a stable choice from a moving one.

    python benchmarks/heldout_texts.py /tmp/heldout
    T=/tmp/heldout; python benchmarks/recall_query_drift.py --text $T/gpl3.txt,$T/bash_man.txt,\
$T/python_docstrings.txt,$T/idle_news.txt --lengths 900 --budget 128 --threads 1 \
        --out benchmarks/results_recall_query_drift_128.json
"""

from __future__ import annotations

import json

import torch

from h2ochat.recall.tier import RecallTier
from tier_probe import probe_arguments, probe_trials  # (benchmarks/)
from json_report import write

THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99)


class DriftTier(RecallTier):
    """The shipped tier, recording each decode step's query similarity and the pages its choice loaded."""

    steps: list = []  # (similarity, loads, wanted) of every decode choice, every layer (class-wide sink)

    def recall(self, port, queries, rotary, rows=True, rest=None) -> bool:
        group = queries.shape[2]
        decode = group == self.last_query.shape[2] if self.last_query is not None else False
        previous = getattr(self, "_previous", None)
        before = int(self.frames.copied.sum())
        ran = super().recall(port, queries, rotary, rows, rest)
        if not decode or rows is False:  # a chunk's choice: the next decode step has no decode step before it
            self._previous = None
            return ran
        current = queries.float().clone()
        if previous is not None:
            similarity = torch.nn.functional.cosine_similarity(current, previous, dim=-1)  # [B, H, G]
            wanted = int((self.frames.frame_page >= 0).sum())
            DriftTier.steps.append((float(similarity.min()), int(self.frames.copied.sum()) - before, wanted))
        self._previous = current
        return ran


def report(steps: list[tuple[float, int, int]]) -> list[dict]:
    table = []
    for threshold in THRESHOLDS:
        skipped = [s for s in steps if s[0] >= threshold]
        kept = [s for s in steps if s[0] < threshold]
        table.append({
            "threshold": threshold, "steps_skipped_share": round(len(skipped) / len(steps), 4),
            "pages_changed_per_skipped_step": round(sum(s[1] for s in skipped) / len(skipped), 3) if skipped else None,
            "pages_changed_per_kept_step": round(sum(s[1] for s in kept) / len(kept), 3) if kept else None,
            "skipped_steps_that_changed_nothing": round(sum(s[1] == 0 for s in skipped) / len(skipped), 4)
            if skipped else None})
    return table


def main() -> None:
    args = probe_arguments(__doc__.splitlines()[0], lengths="900", depths="0.1,0.5,0.9", threads_default=0).parse_args()
    probed = probe_trials(args, DriftTier, "16", selector="rot4")
    steps = DriftTier.steps
    result = {**probed, "args": vars(args), "decode_choices": len(steps),
              "mean_similarity": sum(s[0] for s in steps) / len(steps),
              "pages_changed_per_step": sum(s[1] for s in steps) / len(steps),
              "pages_wanted_per_step": sum(s[2] for s in steps) / len(steps), "by_threshold": report(steps)}
    write(result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k not in ("trials", "texts")}, indent=1))

if __name__ == "__main__":
    main()
