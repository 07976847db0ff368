"""The server's memory at its defaults: the rows get what a laptop can spare (1 GiB, or half the
free memory when that is less), said in plain words at start-up, with the bound of what a long
conversation's recall store and the parked conversations add."""

from __future__ import annotations

from types import SimpleNamespace

from h2ochat.serve import server
from h2ochat.serve.server import DEFAULT_KV_MEMORY, ServeConfig, choose_rows, prompt_bound

MiB = 1 << 20


def test_the_default_rows_take_a_laptops_share_not_half_the_free_memory(monkeypatch):
    monkeypatch.setattr(server, "available_memory", lambda device: 40 << 30)  # a big machine, mostly free
    rows, said = choose_rows(ServeConfig(model="x", settings=None), 40 * MiB, "cpu")
    assert rows == DEFAULT_KV_MEMORY // (40 * MiB) == 25
    assert said == ("40.00 MiB of KV slots each, 1000.00 MiB in all, from the default "
                    "1.00 GiB; --kv-memory or --max-sequences for more")


def test_a_small_machine_gets_half_its_free_memory(monkeypatch):
    monkeypatch.setattr(server, "available_memory", lambda device: 800 * MiB)
    rows, said = choose_rows(ServeConfig(model="x", settings=None), 40 * MiB, "cpu")
    assert rows == 10 and said.endswith("from half the free memory, 400.00 MiB")


def test_explicit_choices_are_kept_and_said(monkeypatch):
    monkeypatch.setattr(server, "available_memory", lambda device: 40 << 30)
    assert choose_rows(ServeConfig(model="x", settings=None, kv_memory=4 << 30), 40 * MiB, "cpu")[0] == 64
    rows, said = choose_rows(ServeConfig(model="x", settings=None, max_sequences=3), 40 * MiB, "cpu")
    assert rows == 3 and said == "--max-sequences: 40.00 MiB of KV slots each, 120.00 MiB in all"


def test_the_start_up_states_what_a_long_conversation_adds():
    backend = SimpleNamespace(slots=1000, cache=SimpleNamespace(tier_host_bytes_per_token=lambda: 1024))
    config = ServeConfig(model="x", settings=None, max_prompt_tokens=32768, max_tokens=4096)
    said = prompt_bound(backend, config, 8192)
    assert "35.02 MiB at most for one request (32,768 prompt tokens" in said  # (32768 + 4096 - 1000) KiB
    assert "no bound" in prompt_bound(backend, ServeConfig(model="x", settings=None), 8192)
    no_tier = SimpleNamespace(slots=1000, cache=SimpleNamespace(tier_host_bytes_per_token=lambda: 0))
    assert prompt_bound(no_tier, config, 8192) == ""
