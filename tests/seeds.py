"""Fresh random seeds, printed so a failing test can be replayed.

pytest shows a test's captured output only when it fails, so the printed seeds cost nothing on a
pass. Every seed has a label ("test" for the per-test ``seed`` fixture, e.g. "model" for a random
model a module fixture builds); ``H2OCHAT_TEST_SEED=test=5,model=9`` (or one number for all)
replays them. Use: ``from seeds import seed`` (the fixture) and ``fresh("model")`` in fixtures.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

_drawn: dict[str, int] = {}


def _replayed(label: str) -> int | None:
    wanted = os.environ.get("H2OCHAT_TEST_SEED", "").strip()
    if not wanted:
        return None
    if "=" not in wanted:
        return int(wanted)
    pairs = dict(item.split("=", 1) for item in wanted.split(",") if "=" in item)
    return int(pairs[label]) if label in pairs else None


def fresh(label: str) -> int:
    """A new seed (or the replayed one) for ``label``; seeds torch and random with it."""
    value = _replayed(label)
    if value is None:
        value = random.SystemRandom().randrange(2**31)
    _drawn[label] = value
    torch.manual_seed(value)
    random.seed(value)
    return value


@pytest.fixture
def seed() -> int:
    value = fresh("test")
    replay = ",".join(f"{label}={number}" for label, number in _drawn.items())
    print(f"random seeds: {replay} (replay: H2OCHAT_TEST_SEED={replay})")
    return value
