"""Greedy runs of tiny random models through the H2O cache, recorded for lock-step tests across a rewrite.

Issue 23 recomposed the cache (h2ochat/cache.py and recall/tiered.py's subclasses became h2ochat/kv/ and
recall/tier.py) with its behaviour unchanged. This script runs a fixed list of cases (``CASES``: every
policy, the three families, with and without recall, eager, compiled, Triton under the interpreter, a
padded batch, runs across compact re-numbering) through whichever h2ochat is importable, using only what
both versions share (``CacheSettings(...).build``, ``generation.prefill``, ``generation.decoder``,
``layer.state_tensors()``), and records per case: the greedy tokens and logits of every step and every
layer's state after the prefill and after the run. ``tests/test_lockstep_before_composition.py`` replays
the cases with the current code against ``cache_before_composition.pt``, recorded at commit 46a7097: the
last commit before ca865d6 whose tree runs (6646f58 to 392a541 hold no h2ochat/cache.py, and 94999d1's
recall/selectors.py already calls ``kernels.backend_for``, which only the composed kernels have; the
cache-related changes 46a7097..94999d1 are option checks and selector names, no behaviour).

Recording (the code before the change, from a worktree; ``h2ochat_kernels`` must come from the same tree):

    git worktree add /tmp/h2o_before 46a7097
    mkdir -p /tmp/h2o_shim && ln -sfn /tmp/h2o_before/kernels /tmp/h2o_shim/h2ochat_kernels
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/h2o_before:/tmp/h2o_shim:/tmp/h2o_before/tests \\
        .venv/bin/python tests/golden/record_cache_runs.py --tests /tmp/h2o_before/tests \\
        --out tests/golden/cache_before_composition.pt --pick-seeds [--seeds-from OLD.pt]

It prints which ``h2ochat`` and ``h2ochat_kernels`` it imported (and refuses modules of another tree).
With ``--pick-seeds`` each case's seed is the first (from its own) whose run has no near-tie: no
greedy choice between two logits within 1e-4, no eviction (one slot out, or a prefill chunk's best C)
between two priorities within the lockstep tolerance (tests/lockstep.py), measured on the eager run (a
compiled or Triton case on its eager twin).
Exact ties (empty slots, equal integer ranks) stay: the rule that breaks them is part of the behaviour.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# the Triton interpreter must be chosen before triton is first imported (transformers imports it)
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

LOGIT_MARGIN = 1e-4  # a greedy choice closer than this is a near-tie
TIE_RTOL, TIE_ATOL = 1e-4, 1e-6  # tests/lockstep.py's tie


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    policy: str = "h2o"
    mode: str = "eager"  # eager, compiled (dynamo aot_eager), triton (H2OCHAT_KERNELS=triton, interpreter)
    budget: str = "10"
    recall: str | None = None
    page: int = 4
    selector: str = "rot4"
    batch: int = 2
    padding: int = 3  # left padding of the last row (0: none)
    prompt: int = 20
    steps: int = 20
    chunk: int = 8
    max_positions: int = 32  # the model's limit: 20 + 20 tokens cross a compact re-numbering
    seed: int = 0


def _cases() -> list[Case]:
    cases = []
    families = ("opt", "llama", "neox")
    evicting = ("h2o", "mean", "decay", "tova", "sink", "local", "random")
    for family in families:
        for policy in evicting:  # a padded batch of two, re-numbered on the way
            cases.append(Case(f"{family}-{policy}", family, policy))
        cases.append(Case(f"{family}-full", family, "full", max_positions=64))  # grows; never re-numbers
        cases.append(Case(f"{family}-h2o-one-row", family, "h2o", batch=1, padding=0))
        cases.append(Case(f"{family}-h2o-no-renumbering", family, "h2o", max_positions=64))
        for selector in ("rot4", "exact"):
            cases.append(Case(f"{family}-recall-{selector}", family, "h2o", budget="16", recall="8", selector=selector))
        cases.append(Case(f"{family}-compiled-h2o", family, "h2o", mode="compiled"))
    for policy in ("mean", "tova", "sink", "local", "decay"):
        cases.append(Case(f"llama-recall-{policy}", "llama", policy, budget="16", recall="8"))
    # dynamo compiles once per graph (minutes of CPU would be inductor's: aot_eager captures the same
    # graph), a few seconds each: recall compiled in one family (OPT: a re-numbering needs no second
    # graph, with RoPE it turns on the re-rotation of recalled keys); random and full run eagerly under it
    cases.append(Case("opt-compiled-recall", "opt", "h2o", mode="compiled", budget="16", recall="8"))
    for policy in ("tova", "random", "full"):
        cases.append(Case(f"llama-compiled-{policy}", "llama", policy, mode="compiled",
                          max_positions=64 if policy == "full" else 32))
    # the interpreter is ~1000x slower than torch: short runs (they still evict and re-number)
    triton = dict(mode="triton", prompt=10, steps=5, chunk=4, max_positions=13, budget="8")
    # (a score decay in the attention kernels, a rank by score / age x value norm, sinks: the fused eviction)
    cases.append(Case("llama-triton-mean", "llama", "mean:decay=0.5:value_eps=0.1", **triton))
    # (recall 4 in pages of 2: since the staging page (issue 24) recall takes at least two pages)
    cases.append(Case("neox-triton-recall", "neox", "h2o", **{**triton, "budget": "12", "recall": "4", "page": 2,
                                                               "max_positions": 14}))
    return cases


CASES = _cases()


# -- running a case --------------------------------------------------------------------------------
@contextlib.contextmanager
def _kernels(mode: str):
    before = os.environ.get("H2OCHAT_KERNELS")
    os.environ["H2OCHAT_KERNELS"] = "triton" if mode == "triton" else "torch"
    try:
        yield
    finally:
        if before is None:
            del os.environ["H2OCHAT_KERNELS"]
        else:
            os.environ["H2OCHAT_KERNELS"] = before


def _prompt(case: Case, model):
    gen = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(3, model.config.vocab_size, (case.batch, case.prompt), generator=gen)
    if not case.padding:
        return ids, None
    mask = torch.ones_like(ids)
    mask[-1, : case.padding] = 0
    ids[-1, : case.padding] = model.config.pad_token_id
    return ids, mask


def _reduced(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A small stand-in for a big float tensor [..., D]: its sum and norm over D (float64 sums)."""
    t = tensor.double()
    return {"sum": t.sum(-1).float(), "norm": t.norm(dim=-1).float()}


def layer_state(layer) -> dict[str, torch.Tensor]:
    """The layer's state (``state_tensors``, both versions), a 4-D tensor (keys, values, the cold
    store's, a digest's) reduced over its last dimension."""
    state = {}
    for name, tensor in layer.state_tensors().items():
        if tensor.dim() >= 4:
            for part, value in _reduced(tensor).items():
                state[f"{name}.{part}"] = value.clone()
        else:
            state[name] = tensor.detach().clone()
    return state


def cache_state(cache) -> dict:
    counters = {}
    for name in ("tokens_fed", "next_position"):
        value = getattr(cache, name, None)
        if isinstance(value, torch.Tensor):
            counters[name] = value.clone()
    counters["compactions"] = torch.tensor(int(getattr(cache, "compactions", 0)))
    counters["evicted_tokens"] = torch.tensor(int(cache.evicted_tokens()))
    return {"counters": counters, "layers": [layer_state(layer) for layer in cache.layers]}


class TieWatch:
    """Near-ties in an eager run: wraps each layer's ``priority`` (and ``evict_one`` / ``_select``, to
    know which choice it ranks for) as instance attributes; records the closest call."""

    def __init__(self, cache):
        self.cache = cache
        self.near = []  # descriptions of near-ties
        self.mode = None
        for layer in cache.layers:
            self._wrap(layer)

    @staticmethod
    def is_tie(a: float, b: float) -> bool:
        return a != b and abs(a - b) <= TIE_ATOL + TIE_RTOL * max(abs(a), abs(b))

    def _wrap(self, layer):
        original_priority, original_evict, original_select = layer.priority, layer.evict_one, layer._select
        watch = self

        def priority(scores, token_index, newest, value_norm):
            result = original_priority(scores, token_index, newest, value_norm)
            if watch.mode == "evict":
                p = result.clone()
                if p.shape[-1] > layer.capacity:  # recall columns: never the victim
                    p[..., layer.capacity:] = float("inf")
                low = p.topk(2, dim=-1, largest=False).values
                for a, b in zip(low[..., 0].flatten().tolist(), low[..., 1].flatten().tolist()):
                    if abs(a) != float("inf") and abs(b) != float("inf") and watch.is_tie(a, b):
                        watch.near.append(f"layer {layer.layer_idx} evict {a} vs {b}")
            elif watch.mode == "select":
                keep = layer.capacity
                if result.shape[-1] > keep:
                    top = result.topk(keep + 1, dim=-1).values
                    for a, b in zip(top[..., keep - 1].flatten().tolist(), top[..., keep].flatten().tolist()):
                        if abs(a) != float("inf") and abs(b) != float("inf") and watch.is_tie(a, b):
                            watch.near.append(f"layer {layer.layer_idx} select {a} vs {b}")
            return result

        def evict_one(*args, **kwargs):
            watch.mode = "evict"
            try:
                return original_evict(*args, **kwargs)
            finally:
                watch.mode = None

        def select(*args, **kwargs):
            watch.mode = "select"
            try:
                return original_select(*args, **kwargs)
            finally:
                watch.mode = None

        layer.priority, layer.evict_one, layer._select = priority, evict_one, select


def logit_near_ties(logits: torch.Tensor) -> list[str]:
    top = logits.float().topk(2, dim=-1).values
    gaps = (top[..., 0] - top[..., 1]).flatten().tolist()
    return [f"greedy gap {gap:.2e}" for gap in gaps if gap < LOGIT_MARGIN]


def run_case(case: Case, feed: torch.Tensor | None = None, watch_ties: bool = False) -> dict:
    """The case's run: prefill, then ``case.steps`` greedy decode steps (fed ``feed`` [steps, B] instead
    of the run's own choices when given: a replay stays in step with the recording). Returns tokens
    (the run's own greedy choices), logits (prefill's last, then every step's), the cache state after
    the prefill and after the run, and with ``watch_ties`` the near-ties met (eager cases only)."""
    from conftest import build_model

    try:
        from h2ochat.engine import compiled, generation
    except ImportError:  # a tree from before issue 33's layout (the commit the goldens were recorded at)
        from h2ochat import compiled, generation

    torch.manual_seed(0)
    model = build_model(case.family, seed=case.seed, max_position_embeddings=case.max_positions)
    ids, mask = _prompt(case, model)
    settings = generation.CacheSettings(policy=case.policy, budget=case.budget, recall=case.recall, page=case.page,
                                        selector=case.selector, seed=case.seed)
    near = []
    with _kernels(case.mode):
        cache = settings.build(model)
        watch = TieWatch(cache) if watch_ties else None
        if case.mode == "compiled":
            compiled.BACKEND = "aot_eager"  # dynamo's capture without inductor's code generation
        step = generation.decoder(model, compile=case.mode == "compiled")
        logits = generation.prefill(model, cache, ids, mask, chunk=case.chunk)
        after_prefill = cache_state(cache)
        all_logits, tokens = [logits.float().clone()], []
        near += logit_near_ties(logits)
        for index in range(case.steps):
            token = logits.argmax(-1)
            tokens.append(token.clone())
            logits = step(cache, feed[index] if feed is not None else token)
            all_logits.append(logits.float().clone())
            if index + 1 < case.steps:
                near += logit_near_ties(logits)
        if watch is not None:
            near += watch.near
        final = cache_state(cache)
    return {"tokens": torch.stack(tokens), "logits": torch.stack(all_logits), "prefill": after_prefill,
            "final": final, "near_ties": near, "compiled_decoder": type(step).__name__}


def _compact(x):
    """Integer tensors in the smallest type that holds them (the file stays small; compared as int64)."""
    if isinstance(x, dict):
        return {k: _compact(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_compact(v) for v in x]
    if isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.numel():
        for dtype in (torch.int8, torch.int16, torch.int32):
            info = torch.iinfo(dtype)
            if info.min <= int(x.min()) and int(x.max()) <= info.max:
                return x.to(dtype)
    return x


def save(recording: dict, path) -> None:
    """``torch.save`` of the compacted recording, gzipped."""
    buffer = io.BytesIO()
    torch.save(_compact(recording), buffer)
    Path(path).write_bytes(gzip.compress(buffer.getvalue(), 9, mtime=0))


def load(path) -> dict:
    return torch.load(io.BytesIO(gzip.decompress(Path(path).read_bytes())), weights_only=True)


def pick_seed(case: Case, tries: int = 40) -> Case:
    """The case with the first seed (from its own) whose eager twin meets no near-tie."""
    for seed in range(case.seed, case.seed + tries):
        candidate = replace(case, seed=seed)
        twin = replace(candidate, mode="eager")
        near = run_case(twin, watch_ties=True)["near_ties"]
        if not near:
            return candidate
        print(f"  {case.name} seed {seed}: {len(near)} near-ties ({near[0]})", flush=True)
    raise RuntimeError(f"{case.name}: no seed without near-ties in {tries}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", required=True, help="the tests/ folder whose conftest builds the models")
    parser.add_argument("--out", required=True)
    parser.add_argument("--pick-seeds", action="store_true")
    parser.add_argument("--seeds-from", help="a recording whose seeds to reuse (for the cases it holds unchanged)")
    parser.add_argument("--only", nargs="*", help="case names")
    args = parser.parse_args()
    sys.path.insert(0, args.tests)
    torch.set_num_threads(1)
    import h2ochat
    import h2ochat_kernels

    print(f"h2ochat from {h2ochat.__file__}\nh2ochat_kernels from {h2ochat_kernels.__file__}", flush=True)
    import conftest

    print(f"conftest from {conftest.__file__}", flush=True)
    roots = (Path(h2ochat.__file__).parent, Path(h2ochat_kernels.__file__).parent)
    seeds = {}
    if args.seeds_from:
        seeds = {name: entry["case"] for name, entry in load(args.seeds_from)["cases"].items()}
    cases = [c for c in CASES if not args.only or c.name in args.only]
    recorded = {}
    for case in cases:
        start = time.perf_counter()
        if case.name in seeds and {**seeds[case.name], "seed": case.seed} == asdict(case):  # the same case
            case = replace(case, seed=seeds[case.name]["seed"])
        elif args.pick_seeds:
            case = pick_seed(case)
        record = run_case(case)
        near = record.pop("near_ties")
        recorded[case.name] = {"case": asdict(case), "record": record}
        print(f"{case.name}: seed {case.seed}, {time.perf_counter() - start:.2f} s, "
              f"{int(record['final']['counters']['evicted_tokens'])} evicted, "
              f"{int(record['final']['counters']['compactions'])} re-numberings, {record['compiled_decoder']}"
              + (f", near-ties {near[:2]}" if near else ""), flush=True)
    strays = [name for name, module in sys.modules.items()
              if name.split(".")[0] in ("h2ochat", "h2ochat_kernels") and getattr(module, "__file__", None)
              and not any(Path(module.__file__).is_relative_to(root) for root in roots)]
    assert not strays, f"modules from another tree: {strays}"
    source = Path(h2ochat.__file__).parent.parent
    git = ["git", "-C", str(source)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", "h2ochat", "kernels"],
                           capture_output=True, text=True).stdout.strip()
    save({"source": str(source), "commit": commit + ("+changes" if dirty else ""), "torch": str(torch.__version__),
          "cases": recorded}, args.out)
    print(f"wrote {args.out}: {os.path.getsize(args.out)} bytes", flush=True)


if __name__ == "__main__":
    main()
