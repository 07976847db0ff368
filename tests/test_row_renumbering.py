"""Each row is re-numbered on its own count (``--positions compact``): when a row's next tokens would
pass the model's position limit, that row's held tokens get new positions, and the rows beside it keep
theirs bit for bit. So a served chat's positions, keys and tokens do not depend on how long the chats
beside it are (issue 34's served independence, past the limit), for h2o and recall rows alike.
"""

from __future__ import annotations

import random

import pytest
import torch

from h2ochat.kv import Renumbering

from conftest import VOCAB, build_model
from serve_fakes import generated, model_engine
from test_serve_recall_rows import prompt, run

POSITIONS = 64  # the tiny models' limit (conftest)


def _held(batch=3, slots=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.randperm(200, generator=generator)[:slots] for _ in range(batch)]).sort(-1).values
    positions[:, :2] = -1  # empty slots
    return positions, positions >= 0


def test_rows_left_out_of_a_renumbering_keep_their_positions_bit_for_bit():
    positions, valid = _held()
    rows = torch.tensor([True, False, True])
    renumbering = Renumbering.of(3, [(positions, valid)], span=6, rows=rows)
    moved = renumbering.apply(positions, valid)
    assert torch.equal(moved[1], positions[1])
    now = torch.tensor([150, 190, 170])
    assert renumbering.next_position(now)[1] == 190
    for row in (0, 2):  # a moving row goes where a re-numbering of it alone takes it
        alone = Renumbering.of(1, [(positions[row : row + 1], valid[row : row + 1])], span=6)
        assert torch.equal(moved[row], alone.apply(positions[row : row + 1], valid[row : row + 1])[0])
        assert renumbering.next_position(now)[row] == alone.next_position(now[row : row + 1])[0]
    assert not torch.equal(moved[0], positions[0])


CACHES = {
    "h2o": {},
    "recall": dict(recall="8", page=4),
    "recall int8 slots": dict(recall="8", page=4, kv_dtype="int8"),
}


@pytest.mark.parametrize("kind", list(CACHES))
def test_a_chat_past_the_position_limit_beside_longer_ones_gives_its_tokens_alone(family, seed, kind):
    """The chat itself passes the 64 positions (it is re-numbered at its own time, as alone), and the
    chats beside it pass them at other steps: with the batch re-numbered whole, a neighbour reaching
    the limit moved the chat's positions too and its tokens changed."""
    rng = random.Random(seed)
    model = build_model(family)
    chat = prompt(rng, 24, 28)
    # (one bucket: alone and beside, the chat runs steps of 4 rows, whose sums round alike; a bucket's own
    # re-numbering is tests/test_serve_rows.py's, a 1-row step past the limit on an 8-row server)
    new_engine = lambda: model_engine(model, 4, budget="16", chunk=5, cache=CACHES[kind], buckets=(4,))[0]  # noqa: E731
    alone = run(new_engine(), [(0, chat, 50)])[0]
    assert len(chat) + 50 > POSITIONS
    scheduler = new_engine()
    others = [(0, prompt(rng, 40, 44), 60), (2, prompt(rng, 30, 34), 70)]
    beside = run(scheduler, [*others, (9, chat, 50)])
    renumbered = scheduler.backend.cache.compactions
    assert renumbered >= 3, renumbered  # (rows reached the limit at several steps)
    assert generated(next(r for r in beside if r.prompt_ids == chat)) == generated(alone)
