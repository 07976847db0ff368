"""Half precision on the CPU: the tiny OPT, LLaMA and GPT-NeoX models in float16 and bfloat16 against
the same weights in float32, through the same H2O cache on the same tokens.

What must hold: logits stay within a few roundings of the float32 run; eviction choices agree, and
where they do not, the two tokens' float32 scores tie within the scores' rounding; scores are
float32 whatever the model's dtype; re-numbering past the position limit rotates half-precision keys
without drifting away from the float32 run.

The tiny random models attend almost uniformly (weights of std 0.02), which would make every
eviction a choice by age. Their attention is sharpened (each attention module's scaling x100, the
same in every dtype) so that choices depend on what the tokens are, as in a trained model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from h2ochat.kv import H2OLayer
from h2ochat.engine.generation import CacheSettings, forward, prefill

from conftest import FAMILIES, build_model, random_ids

# machine epsilon (1 to the next number): fp16 has 11 significant bits, bf16 8
EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
HALVES = list(EPS)
SHARPEN = 100.0
BATCH, TOKENS, SLOTS = 3, 60, 8

# Tolerances, in units of the dtype's epsilon (each op rounds its result to within eps/2 of its
# size; a two-layer model puts about a dozen roundings between the tokens and the logits, and they
# partly cancel):
# - logits: 6 eps of the run's largest |logit| (measured at most 2.9 eps over 20 seeds, before any
#   eviction choice differs; after one differs the runs attend different tokens and are not compared);
# - scores: 6 eps of the (sequence, head)'s top score (measured at most 2.7 eps). A score is a sum
#   of attention probabilities computed in fp32 from half-precision queries and keys, so its error
#   is that of the attention logits, which the softmax turns into a share of the top score.
# A flipped eviction choice must be between two tokens whose fp32 scores differ by less than the
# score tolerance (measured: at most 0.8 eps).
LOGIT_TOL = 6
SCORE_TOL = 6


def sharpened(family: str):
    model = build_model(family)
    for module in model.modules():
        if hasattr(module, "scaling") and hasattr(module, "layer_idx"):
            module.scaling *= SHARPEN
    return model


class EvictionRecorder:
    """Every decode-step eviction of every cache (keyed by its row policies, which its layers share): the slots' token indices and scores at the moment
    of the choice (after this step's attention was added, before the eviction)."""

    def __init__(self, monkeypatch):
        self.by_cache: dict[int, dict[int, list]] = {}
        evict = H2OLayer.evict_one

        def recording(layer, *args, **kwargs):
            self.by_cache.setdefault(id(layer.row_policies), {}).setdefault(layer.layer_idx, []).append(
                (layer.token_index.clone(), layer.scores.clone()))
            return evict(layer, *args, **kwargs)

        monkeypatch.setattr(H2OLayer, "evict_one", recording)


def run(model, ids, recorder):
    """Prefill SLOTS tokens, then decode the rest token by token (teacher-forced): logits per step
    [B, steps, V] in fp32, the cache, and its recorded choices per layer."""
    cache = CacheSettings(budget=str(SLOTS)).build(model)
    logits = [prefill(model, cache, ids[:, :SLOTS])]
    logits += [forward(model, cache, ids[:, t : t + 1])[:, -1] for t in range(SLOTS, ids.shape[1])]
    return torch.stack(logits, 1).float(), cache, recorder.by_cache[id(cache.row_policies)]


def held(snapshot, b, h) -> dict[int, float]:
    tokens, scores = snapshot
    return {int(t): float(s) for t, s in zip(tokens[b, h], scores[b, h]) if t >= 0}


def compare_choices(full, half, eps):
    """Walks the decode steps of each sequence, comparing the two runs' choices.

    A choice is comparable when both caches held the same tokens before it. Until the first step at
    which any (layer, head) of a sequence chose differently, the runs have attended the same tokens,
    so their scores may differ only by rounding: they are checked, and a choice that differs must be
    between two tokens whose fp32 scores tie within that rounding. Returns (agreeing, comparable,
    per-sequence index of the first step whose logits are no longer comparable, largest score error
    and largest tie gap seen, both in units of eps times the top score)."""
    layers, steps = len(full), len(full[0])
    agree = comparable = 0
    first_divergence = []
    worst_error = worst_gap = 0.0
    for b in range(BATCH):
        diverged_at = None
        for step in range(steps):
            for layer in range(layers):
                after_full = full[layer][step + 1] if step + 1 < steps else None
                after_half = half[layer][step + 1] if step + 1 < steps else None
                for h in range(full[layer][step][0].shape[1]):
                    a, c = held(full[layer][step], b, h), held(half[layer][step], b, h)
                    if set(a) != set(c):
                        continue
                    top = max(a.values())
                    if diverged_at is None:
                        error = max(abs(a[t] - c[t]) for t in a) / (eps * top)
                        worst_error = max(worst_error, error)
                        assert error <= SCORE_TOL, f"sequence {b} step {step} layer {layer} head {h}: score error {error:.2f} eps"
                    if after_full is None:
                        continue
                    comparable += 1
                    dropped_full = set(a) - set(held(after_full, b, h))
                    dropped_half = set(c) - set(held(after_half, b, h))
                    if dropped_full == dropped_half:
                        agree += 1
                    elif diverged_at is None:
                        (x,), (y,) = dropped_full, dropped_half
                        gap = abs(a[x] - a[y]) / (eps * top)
                        worst_gap = max(worst_gap, gap)
                        assert gap <= SCORE_TOL, (f"sequence {b} step {step} layer {layer} head {h}: fp32 dropped token {x} "
                                                  f"(score {a[x]:.5f}), half dropped {y} ({a[y]:.5f}): gap {gap:.2f} eps")
            if diverged_at is None and step + 1 < steps and any(
                    held(full[layer][step + 1], b, h).keys() != held(half[layer][step + 1], b, h).keys()
                    for layer in range(layers) for h in range(full[layer][0][0].shape[1])):
                diverged_at = step + 1
        first_divergence.append(steps if diverged_at is None else diverged_at)
    return agree, comparable, first_divergence, worst_error, worst_gap


@pytest.mark.parametrize("dtype", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_half_precision_matches_float32(family, dtype, seed, monkeypatch):
    recorder = EvictionRecorder(monkeypatch)
    model = sharpened(family)
    ids = random_ids(BATCH, TOKENS)
    logits32, cache32, choices32 = run(model, ids, recorder)
    logits16, cache16, choices16 = run(copy.deepcopy(model).to(dtype), ids, recorder)
    eps = EPS[dtype]

    for layer in cache16.layers:  # half-precision slots, fp32 bookkeeping
        assert layer.keys.dtype == layer.values.dtype == dtype
        assert layer.scores.dtype == torch.float32
    assert cache16.evicted_tokens() == cache32.evicted_tokens() > 0

    agree, comparable, first_divergence, score_error, tie_gap = compare_choices(choices32, choices16, eps)
    scale = float(logits32.abs().max())
    # logits row 0 comes from the prefill, row 1 + s from decode step s: comparable while the caches agreed
    worst = 0.0
    for b, diverged in enumerate(first_divergence):
        diff = float((logits16[b, : diverged + 1] - logits32[b, : diverged + 1]).abs().max())
        worst = max(worst, diff / (eps * scale))
    print(f"{family} {str(dtype)[6:]}: eviction choices agree {agree}/{comparable} ({agree / comparable:.1%}); "
          f"logits within {worst:.2f} eps of the largest |logit| {scale:.2f}; scores within {score_error:.2f} eps "
          f"of the top score; widest tie that flipped {tie_gap:.2f} eps")
    assert worst <= LOGIT_TOL, f"logits differ by {worst:.2f} eps of their scale"
    assert agree / comparable >= 0.9


@pytest.mark.parametrize("dtype", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("family", ["llama", "neox"])
def test_renumbering_half_precision_keys_stays_with_float32(family, dtype, seed):
    """A sliding window re-numbered many times (keys rotated in place each time) in half precision
    follows the float32 run as closely as it did before the first re-numbering."""
    model = build_model(family)  # 64 positions
    half = copy.deepcopy(model).to(dtype)
    ids = random_ids(1, 240)
    caches = [CacheSettings(policy="local", budget="12").build(m) for m in (model, half)]
    diffs = []
    for t in range(ids.shape[1]):
        a, b = (forward(m, c, ids[:, t : t + 1]).float() for m, c in zip((model, half), caches))
        diffs.append(float((a - b).abs().max()) / float(a.abs().max()))
    assert caches[1].compactions == caches[0].compactions >= 4
    before = max(diffs[:64])  # up to the first re-numbering
    after = max(diffs[64:])
    print(f"{family} {str(dtype)[6:]}: logits within {before / EPS[dtype]:.2f} eps before the first re-numbering, "
          f"{after / EPS[dtype]:.2f} eps over {caches[1].compactions} re-numberings")
    assert after <= max(2 * before, LOGIT_TOL * EPS[dtype])


# -- re-numbering drift -------------------------------------------------------------------------------

def rotate_exactly(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The rotate-half rotation of ``keys`` [..., S, D] by ``delta`` [..., S] positions, in float64."""
    half = inv_freq.numel()
    angles = delta.double().unsqueeze(-1) * inv_freq.double()
    cos, sin = angles.cos(), angles.sin()
    first, second = keys[..., :half].double(), keys[..., half : 2 * half].double()
    return torch.cat([first * cos - second * sin, second * cos + first * sin, keys[..., 2 * half :].double()], dim=-1)


def pair_relative(error: torch.Tensor, exact: torch.Tensor, half: int) -> torch.Tensor:
    """``error`` of each rotated element relative to the norm of its rotation pair (x_i, x_i+half):
    a rotation preserves that norm, so errors neither grow nor shrink with the angle."""
    norm = (exact[..., :half] ** 2 + exact[..., half : 2 * half] ** 2).sqrt()
    return error[..., : 2 * half] / torch.cat([norm, norm], dim=-1)


@pytest.mark.parametrize("largest_delta", [8, 4096, 131072], ids=["small-moves", "4k-moves", "128k-moves"])
@pytest.mark.parametrize("dtype", HALVES, ids=["fp16", "bf16"])
def test_fifty_renumberings_drift_like_fifty_roundings(dtype, largest_delta, seed):
    """Rotating half-precision keys 50 times (50 re-numberings) by random moves lands within the
    rounding of 50 independent roundings of one exact rotation by their sum.

    Derivation of the bound. ``rotate_keys`` rotates in fp32 and rounds once per call, so each
    re-numbering adds one rounding error per element: uniform in +-ulp/2, of standard deviation
    ulp / sqrt(12). With 8 significant bits (bf16) ulp/|x| lies in (2^-8, 2^-7], so one rounding
    has an RMS below 2^-9 of |x| (2^-12 for fp16, 11 bits). The rotations that follow preserve
    norms, so the errors are carried, not amplified, and 50 independent ones add up as a random
    walk: at most sqrt(50) * 2^-9 ~ 0.014 of |x| (RMS) for bf16, sqrt(50) * 2^-12 for fp16.
    Sharper: the test measures rho, the RMS error of rounding the exact result once (the best a
    half-precision cache can hold; ~0.6 of the 2^-9 above, relative to the rotation pair's norm),
    and for moves of thousands of positions, as a re-numbering makes of recent tokens, allows
    1.35 * sqrt(50) * rho (measured 1.00). Two ways to fail it, both measured: rotating in the
    keys' own precision (several roundings per call: 1.7-1.9), and fp32 angles, whose error grows
    with the move (fp16, 128k-position moves: 2.1; fixed with float64 angles).

    Small moves (a few positions: old heavy hitters re-numbered again and again) drift more than a
    random walk: a rotation smaller than half an ulp rounds back to where it started, so part of
    it is lost each time, the same way (measured 1.3-1.6 x sqrt(50) * rho, some dims 3x). Round-to-
    nearest storage cannot avoid that; they are held to the analytic bound only."""
    from h2ochat.rotary import Rotary, rotate_keys

    dim, calls = 64, 50
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    rotary = Rotary(inv_freq=inv_freq, rotary_dim=dim)
    keys = torch.randn(4, 2, 256, dim).to(dtype)
    original = keys.clone()
    total = torch.zeros(4, 2, 256, dtype=torch.long)
    for _ in range(calls):  # a re-numbering moves tokens down: delta <= 0
        delta = -torch.randint(0, largest_delta + 1, total.shape)
        rotate_keys(keys, delta, rotary)
        total += delta
    exact = rotate_exactly(original, total, inv_freq)
    drift = pair_relative(keys.double() - exact, exact, dim // 2).pow(2).mean().sqrt().item()
    rho = pair_relative(exact.to(dtype).double() - exact, exact, dim // 2).pow(2).mean().sqrt().item()
    ratio = drift / (calls**0.5 * rho)
    analytic = calls**0.5 * EPS[dtype] / 4  # sqrt(50) * 2^-9 for bf16, sqrt(50) * 2^-12 for fp16
    print(f"{str(dtype)[6:]}, moves up to {largest_delta}: drift after {calls} re-numberings {drift:.5f} RMS "
          f"(one rounding {rho:.5f}; {ratio:.2f} x sqrt({calls}) roundings; analytic bound {analytic:.5f})")
    assert drift <= analytic
    if largest_delta >= 1000:
        assert ratio <= 1.35
