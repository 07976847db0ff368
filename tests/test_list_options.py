"""The list-valued options of eval and bench check each item with the function (and the choice table)
the single-valued option of run, generate, story and serve is checked with: a bad item gets the same
one-line error, before any model loads, and a non-zero exit."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("no_model_load")


@pytest.fixture
def no_model_load(monkeypatch):
    """Every case here must fail on its options alone: loading a model is a test failure. (The command
    modules are imported first, so none keeps the stand-in after the test: each name bound to the
    loader is replaced for this test only.)"""
    import importlib
    import sys

    from h2ochat.loading import models

    for name in ("eval", "bench", "passkey_task", "ruler_task", "generate"):
        importlib.import_module(f"h2ochat.commands.{name}")

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    real = models.load
    for module in [m for name, m in sys.modules.items() if name.startswith("h2ochat") and m is not None]:
        if getattr(module, "load", None) is real:
            monkeypatch.setattr(module, "load", refuse)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("The keeper lit the lamp at dusk. " * 20)
    return str(path)


def error_line(result) -> str:
    """The one error line of a refused command line (other stderr lines are notices, not errors)."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("h2ochat: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


# (the list option as eval or bench takes it, with one bad item; the single-valued option with that item)
SAME_AS_SINGLE = {
    "eval --policies": (["eval", "--policies", "h2o,nope"], ["generate", "--policy", "nope", "hi"]),
    "eval --kv-dtype": (["eval", "--kv-dtype", "auto,int3"], ["generate", "--kv-dtype", "int3", "hi"]),
    "bench --kv-dtype": (["bench", "--kv-dtype", "int8,int3"], ["generate", "--kv-dtype", "int3", "hi"]),
    "eval --budget": (["eval", "--budget", "128,abc"], ["generate", "--budget", "abc", "hi"]),
    "bench --budget": (["bench", "--budget", "abc"], ["generate", "--budget", "abc", "hi"]),
    "eval --recall": (["eval", "--recall", "0.5,abc"], ["generate", "--recall", "abc", "hi"]),
    "eval --selector": (["eval", "--recall", "0.5", "--selector", "nope"], ["generate", "--selector", "nope", "hi"]),
}


@pytest.mark.parametrize("name", SAME_AS_SINGLE)
def test_a_bad_item_gets_the_single_options_error(name, h2ochat_main, text):
    listed, single = SAME_AS_SINGLE[name]
    if listed[0] == "eval":
        listed = [*listed, "--text", text]
    assert error_line(h2ochat_main(*listed)) == error_line(h2ochat_main(*single))


# list options with no single-valued twin: the item named and the choices or the form said
OWN_ERRORS = {
    "eval --page": (["eval", "--recall", "0.5", "--page", "8,0"], "--page must be a whole number of tokens >= 1"),
    "eval --task": (["eval", "--task", "nope"], "--task must be perplexity, passkey, ruler or chat-memory"),
    "eval --ruler-tasks": (["eval", "--task", "ruler", "--ruler-tasks", "niah_single_1,nope"],
                           "unknown RULER task 'nope': choose from niah_single_1,"),
    "eval --turns": (["eval", "--task", "chat-memory", "--turns", "0,x"], "--turns takes comma-separated"),
    "eval --lengths": (["eval", "--task", "passkey", "--lengths", "880,x"], "--lengths takes comma-separated"),
    "bench --variants": (["bench", "--variants", "h2o,nope"], "--variants takes some of h2o, slots, full, hf"),
    "bench --context": (["bench", "--context", "512,x"], "--context takes comma-separated whole numbers"),
    "bench --batch": (["bench", "--batch", "1,0"], "--batch takes positive whole numbers"),
}


@pytest.mark.parametrize("name", OWN_ERRORS)
def test_a_bad_item_of_a_list_option_is_one_line(name, h2ochat_main, text):
    args, expected = OWN_ERRORS[name]
    if args[0] == "eval" and "--task" not in args[:3] or "passkey" in args:
        args = [*args, "--text", text]
    assert expected in error_line(h2ochat_main(*args))


def test_the_list_options_help_lists_the_single_options_choices():
    from h2ochat import options as o
    from h2ochat.cli import build_command

    helps = {(name, param.opts[0]): param.help for name in ("eval", "bench") for param in build_command(name).params
             if getattr(param, "help", None)}
    for key, single in ((("eval", "--kv-dtype"), o.KvDtype), (("bench", "--kv-dtype"), o.KvDtype),
                        (("eval", "--policies"), o.Policy), (("eval", "--page"), o.Page)):
        assert helps[key].endswith(o.help_of(single)), key
    for key in (("eval", "--budget"), ("bench", "--budget")):  # where a share differs, the help says of what
        assert "un, generate, story and serve take a share of the context window instead" in helps[key]
