"""Every setting is wired everywhere: the settings are the fields of ChatSettings, its Sampling and
its CacheSettings, and `/set`, its listing, the conversation file and `run --continue`'s overrides
all derive from them. A new field that one of these misses fails here."""

from __future__ import annotations

import io
import inspect
import json
from dataclasses import fields

import pytest
from typer.testing import CliRunner

from h2ochat.chat import history
from h2ochat.chat.conversation import Conversation
from h2ochat.chat.settings import SETTINGS, ChatSettings
from h2ochat.config import Sampling
from h2ochat.cli import app
from h2ochat.commands.run import run
from h2ochat.engine.generation import CacheSettings
from h2ochat.loading.models import load
from h2ochat.chat.repl import Repl
from h2ochat.console import make_console

runner = CliRunner()

# a value other than the default for every setting, as typed and as stored
SAMPLE = {
    "system": ("be brief", "be brief"),
    "temperature": ("0.3", 0.3),
    "top_p": ("0.9", 0.9),
    "top_k": ("5", 5),
    "seed": ("5", 5),
    "repetition_penalty": ("1.2", 1.2),
    "repeat_last_n": ("16", 16),
    "max_new_tokens": ("3", 3),
    "policy": ("mean", "mean"),
    "budget": ("24", "24"),
    "heavy_ratio": ("0.25", 0.25),
    "sinks": ("2", 2),
    "decay": ("0.9", 0.9),
    "positions": ("absolute", "absolute"),
    "page": ("4", 4),  # before recall: 8 recall slots are two pages of 4, not half of one of 16
    "recall": ("8", "8"),
    "selector": ("exact", "exact"),
    "cold_dtype": ("int8", "int8"),
    "cold_limit": ("64", 64),
    "recall_every": ("2", 2),
    "recall_decode_rule": ("before", "before"),
    "recall_rest": ("pages", "pages"),
    "kv_dtype": ("float16", "float16"),  # (a float cast: it goes with the sample --recall)
}


def test_the_settings_are_the_dataclass_fields():
    own = {f.name for f in fields(ChatSettings)} - {"sampling", "cache"}
    sampling = {f.name for f in fields(Sampling)} - {"row_generators"}  # a call's state, not a setting
    cache = {f.name for f in fields(CacheSettings)}
    assert set(SETTINGS) == own | sampling | cache  # the cache's seed is the sampling's (one name, one value)
    assert set(SAMPLE) == set(SETTINGS)  # a new setting needs a sample value here, and is then tested
    for name, (_, value) in SAMPLE.items():
        assert value != ChatSettings().get(name), f"{name}: the sample must differ from the default"


def test_every_setting_round_trips_through_set_its_listing_and_the_file(tiny_checkpoint):
    loaded = load(str(tiny_checkpoint), device="cpu", dtype="float32")
    conv = Conversation(loaded.model, loaded.tokenizer, ChatSettings(sampling=Sampling(temperature=0.0)))
    out = io.StringIO()
    typed = iter([f"/set {name} {text}" for name, (text, _) in SAMPLE.items()] + ["/set", "/bye"])
    repl = Repl(conv, make_console(file=out), lambda prompt: next(typed))
    assert repl.run() == 0
    assert "error" not in out.getvalue(), out.getvalue()
    for name, (_, value) in SAMPLE.items():
        assert conv.settings.get(name) == value, name
    # 24 slots: 8 for recalled tokens, 16 the policy's
    assert conv.cache.budget.slots == 24 - 8 and conv.cache.policy.name == "mean" and conv.cache.position_mode == "absolute"
    assert conv.settings.cache.seed == 5  # the random policy draws from the same seed
    shown = dict(line.split(None, 1) for line in out.getvalue().splitlines()[-len(SETTINGS):])  # `/set` alone
    assert list(shown) == list(SETTINGS), out.getvalue()
    for name, (_, value) in SAMPLE.items():
        assert shown[name].strip() == (repr(value) if isinstance(value, str) else str(value)), name
    restored = ChatSettings.from_json(json.loads(json.dumps(conv.to_json()))["settings"])
    assert restored == conv.settings


def test_every_setting_given_to_run_continue_wins_over_the_stored_one(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("H2OCHAT_HOME", str(tmp_path))
    options_of_run = inspect.signature(run).parameters  # what typer makes options of
    for name in SETTINGS:  # every setting is a run() option of the same name
        assert name in options_of_run, name
        if not SETTINGS[name].on_cache:  # (the cache's defaults are CacheSettings', o.takes_cache_options)
            assert options_of_run[name].default == ChatSettings().get(name), name
    env = {"NO_COLOR": "1"}
    first = runner.invoke(app, ["run", "--model", str(tiny_checkpoint), "--max-new-tokens", "2", "--temperature", "0"],
                          input="hello\n/bye\n", env=env)
    assert first.exit_code == 0, first.output
    options = [part for name, (text, _) in SAMPLE.items() for part in (f"--{name.replace('_', '-')}", text)]
    second = runner.invoke(app, ["run", "--continue", *options], input="again\n/bye\n", env=env)
    assert second.exit_code == 0, second.output
    (path,) = history.conversations_dir().glob("*.json")
    stored = ChatSettings.from_json(json.loads(path.read_text())["settings"])
    for name, (_, value) in SAMPLE.items():
        assert stored.get(name) == value, name
    assert stored.cache.seed == 5


@pytest.mark.parametrize("name", ["heavy_ratio", "sinks", "decay"])
def test_optional_settings_go_back_to_the_policys_own(name):
    changed, _ = ChatSettings().with_value(name, SAMPLE[name][0])
    back, _ = changed.with_value(name, "default")
    assert back.get(name) is None


def test_a_conversation_file_in_the_shape_before_sampling_was_its_own_part_loads(tmp_path):
    """Files keep every setting but the cache's under its own name (the shape they always had): one
    written before ChatSettings held a Sampling loads with each value where it was."""
    old = {"system": "be brief", "temperature": 0.3, "top_p": 0.9, "top_k": 5, "seed": 5,
           "repetition_penalty": 1.2, "repeat_last_n": 16, "max_new_tokens": 3,
           "cache": {"policy": "mean", "budget": "24", "seed": 5}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"settings": old}))
    loaded = ChatSettings.from_json(json.loads(path.read_text())["settings"])
    assert loaded.sampling == Sampling(temperature=0.3, top_p=0.9, top_k=5, seed=5, repetition_penalty=1.2,
                                       repeat_last_n=16)
    assert (loaded.system, loaded.max_new_tokens, loaded.cache.policy, loaded.cache.budget) == ("be brief", 3, "mean", "24")
    assert loaded.to_json() == {**old, "cache": loaded.to_json()["cache"]}  # written back in the same shape
    assert ChatSettings.from_json({}).sampling.temperature == 0.7  # a missing value takes the chat's default
