"""The suite's random seeds: fixed by default, fresh only when asked for.

CI must give the same verdict on every run, so every seed is a fixed function of its label (and,
for the per-test ``seed`` fixture, of the test's id): running a test alone or in the whole suite
draws the same numbers. Labels: "test" for the per-test ``seed`` fixture, e.g. "model" for a random
model a module fixture builds.

``H2OCHAT_TEST_SEED`` changes that:
- ``random``: fresh seeds from the system, for a fuzzing run (opt-in; a failing test prints the
  seeds it drew);
- ``test=5,model=9`` (or one number for all labels): replay those seeds.

Use: ``from seeds import seed`` (the fixture) and ``fresh("model")`` in fixtures.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

_drawn: dict[str, int] = {}


def fuzzing() -> bool:
    """Whether this run draws fresh seeds (``H2OCHAT_TEST_SEED=random``)."""
    return os.environ.get("H2OCHAT_TEST_SEED", "").strip().lower() == "random"


def _replayed(label: str) -> int | None:
    wanted = os.environ.get("H2OCHAT_TEST_SEED", "").strip()
    if not wanted or fuzzing():
        return None
    if "=" not in wanted:
        return int(wanted)
    pairs = dict(item.split("=", 1) for item in wanted.split(",") if "=" in item)
    return int(pairs[label]) if label in pairs else None


def fixed(label: str, salt: str = "") -> int:
    """The default seed of ``label``: a stable hash (not Python's ``hash``, which changes per process)."""
    return zlib.crc32(f"{label}:{salt}".encode()) % 2**31


def fresh(label: str, salt: str = "") -> int:
    """The seed for ``label`` (fixed, replayed, or drawn when fuzzing); seeds torch and random with it."""
    value = _replayed(label)
    if value is None:
        value = random.SystemRandom().randrange(2**31) if fuzzing() else fixed(label, salt)
    _drawn[label] = value
    torch.manual_seed(value)
    random.seed(value)
    return value


def replay_line() -> str:
    replay = ",".join(f"{label}={number}" for label, number in _drawn.items())
    return f"random seeds: {replay} (replay: H2OCHAT_TEST_SEED={replay})"


@pytest.fixture
def seed(request) -> int:
    value = fresh("test", request.node.nodeid)
    print(replay_line())
    return value
