"""How many project files one decoded token of the chat crosses (issue 23: the route a newcomer follows).

The REPL's second turn is traced with ``sys.setprofile``: every call into a file of h2ochat/ or
h2ochat_kernels/ between two draws of ``generation.sample`` is one token's route (its decode step, its
sampling, its text and the status line when it is redrawn). The longest route of the steady tokens is
printed, a figure for the README's "route of one token", not a ceiling: a ceiling was re-set four
times and code was placed to satisfy it (issue 33). What keeps the route honest are rules a change
cannot meet by moving code: tests/test_structure_rules.py.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

import h2ochat
import h2ochat_kernels

ROOTS = {Path(h2ochat.__file__).parent: "h2ochat", Path(h2ochat_kernels.__file__).parent: "h2ochat_kernels"}

def _project_file(filename: str) -> str | None:
    path = Path(filename)
    for root, name in ROOTS.items():
        if path.is_relative_to(root):
            return f"{name}/{path.relative_to(root)}"
    return None


def token_routes(repl, text: str) -> list[frozenset[str]]:
    """The project files each token of the reply to ``text`` entered (one set per token)."""
    routes: list[set[str]] = [set()]

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "sample" and code.co_filename.endswith("generation.py"):
            routes.append(set())
        name = _project_file(code.co_filename)
        if name is not None:
            routes[-1].add(name)

    sys.setprofile(profile)
    try:
        repl.handle(text)
    finally:
        sys.setprofile(None)
    return [frozenset(route) for route in routes[2:-1]]  # the steady tokens: not the prefill, not the end


@pytest.mark.parametrize("recall", [None, "8"])
def test_the_files_one_decoded_token_crosses(tmp_path, recall, capsys):
    from checkpoints import write_checkpoint

    from h2ochat.chat.conversation import ChatSettings, Conversation
    from h2ochat.config import Sampling
    from h2ochat.engine.generation import CacheSettings
    from h2ochat.loading.models import load
    from h2ochat.chat.repl import Repl
    from h2ochat.console import make_console

    loaded = load(str(write_checkpoint(tmp_path, "llama", max_position_embeddings=256)), device="cpu", dtype="float32")
    cache = CacheSettings(policy="h2o", budget="16", recall=recall, page=4, selector="rot4")
    conv = Conversation(loaded.model, loaded.tokenizer, ChatSettings(sampling=Sampling(temperature=0.0), max_new_tokens=24, cache=cache))
    conv.stop_ids = set()  # every reply runs to max_new_tokens
    repl = Repl(conv, make_console(file=io.StringIO()), lambda prompt: "", model_name="tiny")
    repl.handle("the quick brown fox jumps over the lazy dog, twice: the quick brown fox")  # fills and evicts
    routes = token_routes(repl, "tell me more")
    assert len(routes) > 10
    route = max(routes, key=len)
    assert {"h2ochat/kv/layer.py", "h2ochat_kernels/reference.py", "h2ochat/engine/generation.py"} <= route  # it was traced
    assert ("h2ochat/recall/tier.py" in route) == (recall is not None)
    with capsys.disabled():  # the figure, in the test output whatever the capture
        print(f"\none decoded token {'with recall ' if recall else ''}crosses {len(route)} project files: "
              f"{', '.join(sorted(route))}")
