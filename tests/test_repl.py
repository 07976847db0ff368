"""The REPL driven through prompt-toolkit pipe input: slash commands, save/load, Ctrl-C, history."""

from __future__ import annotations

import io
import json
import re

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from h2ochat.chat.conversation import Conversation
from h2ochat.chat.settings import ChatSettings
from h2ochat.engine.generation import CacheSettings
from h2ochat.chat.history import ConversationLog
from h2ochat.loading.models import load
from h2ochat.chat.repl import PromptReader, Repl, history_path
from h2ochat.console import make_console

from seeds import fresh, seed  # noqa: F401  (fixture)

ANSI = re.compile(r"\x1b\[")


pytestmark = pytest.mark.usefixtures("seed")  # every test prints its seeds (and the model's) if it fails


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from checkpoints import write_checkpoint

    fresh("model")
    return load(str(write_checkpoint(tmp_path_factory.mktemp("repl-llama"), max_position_embeddings=256)), device="cpu", dtype="float32")


def drive(loaded, lines: list[str], history=None, file=None, endless=False, log=None, **settings):
    """Run a REPL over ``lines`` typed into a prompt-toolkit session; returns (repl, output, code)."""
    settings.setdefault("max_new_tokens", 5)
    conv = Conversation(loaded.model, loaded.tokenizer, ChatSettings.from_values({"temperature": 0.0, **settings},
                                                                              CacheSettings(policy="h2o", budget="32")))
    if endless:
        conv.stop_ids = set()  # replies run to max_new_tokens whatever the random model writes
    out = file or io.StringIO()
    with create_pipe_input() as pipe:
        reader = PromptReader(history=history, input=pipe, output=DummyOutput())
        pipe.send_text("".join(line + "\n" for line in lines))
        repl = Repl(conv, make_console(file=out), reader, model_name="tiny", log=log)
        code = repl.run()
    return repl, out.getvalue(), code


def test_slash_commands_change_the_settings_they_name(loaded):
    repl, out, code = drive(loaded, ["/set temperature 0.25", "/set top_p 0.8", "/set top_k 4", "/set seed 9",
                                     "/set max_new_tokens 7", "/set system be kind", "/set repeat-last-n 16",
                                     "/budget 20", "/policy local", "/bye"])
    s = repl.conv.settings
    assert (s.sampling.temperature, s.sampling.top_p, s.sampling.top_k, s.sampling.seed, s.max_new_tokens,
            s.system) == (0.25, 0.8, 4, 9, 7, "be kind")
    assert s.sampling.repeat_last_n == 16 and s.cache.seed == 9
    assert repl.conv.cache.budget.slots == 20 and repl.conv.cache.policy.name == "local"
    assert code == 0
    assert "new cache of 20 slots" in out


def test_policy_lists_every_policy_with_its_line_and_takes_knobs(loaded):
    from h2ochat.policies import POLICIES

    repl, out, _ = drive(loaded, ["/policy", "/policy decay:decay=0.5:sinks=2", "/bye"])
    listing = out.split("new cache of")[0]
    for policy in POLICIES.values():
        assert f"{policy.name}  " in listing and policy.summary in listing
    assert repl.conv.cache.policy.decay == 0.5 and repl.conv.cache.budget.sinks == 2


def test_bad_values_and_unknown_commands_get_one_line(loaded):
    repl, out, code = drive(loaded, ["/set temperature hot", "/budget lots", "/policy nope", "/frobnicate", "/exit"])
    assert repl.conv.settings.sampling.temperature == 0.0 and repl.conv.cache.budget.slots == 32
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 4
    assert "unknown command /frobnicate" in lines[-1] and "/help" in lines[-1]
    assert code == 0


def test_chat_cache_hh_save_clear_load_round_trip(loaded, tmp_path):
    saved = tmp_path / "talk.json"
    repl, out, _ = drive(loaded, ["hello there", '"""', "two lines", 'of text"""', "/cache", "/hh", "/stats",
                                  f"/save {saved}", "/clear", "/load " + str(saved), "/bye"],
                         system="be brief")
    data = json.loads(saved.read_text())
    assert [m["role"] for m in data["messages"]] == ["user", "assistant", "user", "assistant"]
    assert data["messages"][2]["content"] == "two lines\nof text"  # the multi-line block is one message
    assert data["settings"]["system"] == "be brief" and data["settings"]["cache"]["budget"] == "32"
    assert repl.conv.messages == data["messages"]  # /load brought back what /clear dropped
    assert repl.conv.cache.longest_row_tokens() == len(repl.conv.ids) > 0
    assert "KV cache · policy h2o" in out and "heavy hitter" in out
    assert "2 turns" in out
    assert not ANSI.search(out)  # not a terminal: plain text


def legend_counts(out: str) -> dict[str, int]:
    legend = out.strip().splitlines()[-1]
    return {label.strip(): int(count) for label, count in re.findall(r"([a-z /()]+?): (\d+)", legend)}


def test_hh_counts_match_a_hand_count_for_the_recent_window_policy(loaded):
    # the local policy keeps exactly the last 32 tokens in every (layer, head): by hand, the first
    # seen - 32 tokens are evicted everywhere, the rest (and the pending last token) are recent
    repl, out, _ = drive(loaded, ["/policy local", "the quick brown fox jumps over the lazy dog and more", "/hh",
                                  "/bye"], max_new_tokens=20, endless=True)
    conv = repl.conv
    seen, pending = len(conv.ids), len(conv.pending)
    counts = legend_counts(out)
    assert seen > 32
    assert counts["evicted (held in none)"] == seen - 32
    assert counts["recent window / sinks (never evicted)"] == 32 + pending
    assert counts["heavy hitter (held on merit in at least half of them)"] == 0
    assert counts["partly evicted (held in fewer than half)"] == 0
    assert len(counts) == 4  # no --recall: no recalled tokens in the legend


def test_hh_counts_match_the_slots_the_cache_holds(loaded):
    # h2o: a token is evicted when no (layer, KV head) slot holds it, a heavy hitter (outside the
    # recent window) when at least half of them do; counted here from the slots themselves
    repl, out, _ = drive(loaded, ["the quick brown fox jumps over the lazy dog and more", "/hh", "/bye"],
                         max_new_tokens=60, endless=True)
    conv = repl.conv
    seen = len(conv.ids)
    holders = [0] * seen
    total = 0
    for layer in conv.cache.layers:
        for head in layer.token_index[0]:
            total += 1
            for token in head.tolist():
                if token >= 0:
                    holders[token] += 1
    recent = conv.cache.budget.recent
    old = range(0, seen - recent)
    counts = legend_counts(out)
    assert counts["evicted (held in none)"] == sum(holders[t] == 0 for t in range(seen)) > 0
    assert counts["heavy hitter (held on merit in at least half of them)"] == sum(2 * holders[t] >= total for t in old)
    assert counts["partly evicted (held in fewer than half)"] == sum(0 < 2 * holders[t] < total for t in old)


class InterruptingFile(io.StringIO):
    """A terminal stand-in that 'receives Ctrl-C' while the reply is written."""

    def __init__(self, after: int):
        super().__init__()
        self.after = after
        self.count = 0

    def write(self, text):
        if text and not text.startswith(("\n", "[", "note", "(")) and self.after is not None:
            self.count += 1
            if self.count == self.after:
                self.after = None
                raise KeyboardInterrupt
        return super().write(text)


def test_ctrl_c_mid_reply_keeps_session_and_partial_text(loaded):
    repl, out, code = drive(loaded, ["tell me a long story", "and another", "/bye"], max_new_tokens=40,
                            file=InterruptingFile(after=2), endless=True)
    messages = repl.conv.messages
    assert messages[1].get("interrupted") is True
    assert "interrupted" in out
    assert len(messages) == 4 and not messages[3].get("interrupted")  # the next turn ran normally
    assert code == 0


def test_ctrl_d_leaves_and_history_persists(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("H2OCHAT_HOME", str(tmp_path))
    path = history_path()
    assert path.parent == tmp_path
    _, _, code = drive(loaded, ["/set top_k 3", "\x04"], history=path)  # then Ctrl-D
    assert code == 0
    assert "/set top_k 3" in path.read_text()


def test_history_defaults_to_the_xdg_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("H2OCHAT_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert history_path() == tmp_path / "h2ochat" / "history"


# -- conversations kept as they go -------------------------------------------------------------------
class SpyLog(ConversationLog):
    """A conversation log that also remembers every record it wrote."""

    def __init__(self, folder):
        super().__init__("tiny", folder)
        self.writes = []

    def save(self, conversation):
        notice = super().save(conversation)
        if conversation.get("messages"):
            self.writes.append(json.loads(self.path.read_text()))
        return notice


def test_every_turn_and_settings_change_is_kept_atomically(loaded, tmp_path):
    log = SpyLog(tmp_path)
    repl, _, _ = drive(loaded, ["hello there", "/set temperature 0.4", "and again", "/bye"], log=log)
    turns = [len(w["messages"]) for w in log.writes]
    assert turns[0] == 2 and turns[-1] == 4  # written after the first turn, not only at the end
    assert log.writes[1]["settings"]["temperature"] == 0.4 and len(log.writes[1]["messages"]) == 2
    stored = json.loads(log.path.read_text())
    assert stored["messages"] == repl.conv.messages and stored["settings"] == repl.conv.settings.to_json()
    assert stored["id"] == log.id and stored["model"] == "tiny"
    # no temporary file left behind (the hidden lock file stays: removing it would race another session)
    assert [p.name for p in tmp_path.iterdir() if p.name != f".{log.id}.json.lock"] == [f"{log.id}.json"]


def test_a_reply_is_kept_while_it_streams_and_when_interrupted(loaded, tmp_path, monkeypatch):
    import h2ochat.chat.repl as repl_module

    monkeypatch.setattr(repl_module, "SNAPSHOT_S", 0.0)  # write at every piece
    log = SpyLog(tmp_path)
    repl, _, _ = drive(loaded, ["tell me a long story", "/bye"], max_new_tokens=40, file=InterruptingFile(after=6),
                       endless=True, log=log)
    snapshots = [w for w in log.writes if w["messages"][-1].get("interrupted")]
    final = json.loads(log.path.read_text())["messages"]
    assert final[0]["content"] == "tell me a long story"
    assert final[1]["interrupted"] is True and final[1]["content"] == repl.conv.messages[1]["content"]
    partials = [w["messages"][1]["content"] for w in snapshots[:-1]]
    assert len(partials) >= 3  # written while the reply streamed, before the interruption
    assert all(len(a) < len(b) and b.startswith(a) for a, b in zip(partials, partials[1:]))


def test_clear_and_load_start_new_conversations_and_keep_the_old(loaded, tmp_path):
    saved = tmp_path / "explicit.json"
    folder = tmp_path / "kept"
    log = SpyLog(folder)
    drive(loaded, ["hello", f"/save {saved}", "/clear", "second conversation", f"/load {saved}", "/bye"], log=log)
    kept = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}
    firsts = sorted(c["messages"][0]["content"] for c in kept.values())
    assert firsts == ["hello", "hello", "second conversation"]  # /load made a third, the first is untouched
    explicit = json.loads(saved.read_text())
    assert sum(c["messages"] == explicit["messages"] for c in kept.values()) == 2


def test_a_conversation_file_spoiled_meanwhile_is_not_written_over(loaded, tmp_path):
    log = SpyLog(tmp_path)
    repl, _, _ = drive(loaded, ["hello", "/bye"], log=log)
    first = log.path
    first.write_text("{ half a file")
    repl.log = log
    typed = iter(["more", "/bye"])
    repl.read_line = lambda prompt: next(typed)
    out = io.StringIO()
    repl.console = make_console(file=out)
    repl.run()
    assert first.read_text() == "{ half a file"
    assert log.path != first and json.loads(log.path.read_text())["messages"][2]["content"] == "more"
    assert "is not valid JSON" in out.getvalue() and log.id in out.getvalue()


class HangingUpFile(io.StringIO):
    """A terminal that closes (SIGHUP) while the reply is written."""

    def __init__(self, after: int):
        super().__init__()
        self.after, self.count = after, 0

    def write(self, text):
        import os
        import signal

        if text and not text.startswith(("\n", "[", "note", "(")):
            self.count += 1
            if self.count == self.after:
                os.kill(os.getpid(), signal.SIGHUP)
        return super().write(text)


def test_a_closed_terminal_ends_the_reply_keeps_it_and_leaves(loaded, tmp_path):
    import signal

    # a session on a terminal: SIGHUP at its default, also when the suite itself runs under nohup (then
    # it is ignored, and the REPL keeps ignoring it on purpose: the next test)
    outer = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        log = SpyLog(tmp_path)
        repl, _, code = drive(loaded, ["tell me a long story", "this line is never read", "/bye"], max_new_tokens=40,
                              file=HangingUpFile(after=3), endless=True, log=log)
        assert code == 128 + signal.SIGHUP
        kept = json.loads(log.path.read_text())["messages"]
        assert [m["role"] for m in kept] == ["user", "assistant"] and kept[1]["interrupted"] is True
        assert kept[1]["content"] and kept[1]["content"] == repl.conv.messages[1]["content"]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # the handler was only there for the reply
    finally:
        signal.signal(signal.SIGHUP, outer)


def test_under_nohup_a_hangup_neither_ends_the_reply_nor_the_session(loaded, tmp_path):
    """`nohup h2ochat run < script`: SIGHUP is ignored on purpose; a reply in progress must run to its
    end and the session go on to the next line (issue 15, item 5)."""
    import signal

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        repl, _, code = drive(loaded, ["tell me a long story", "and another", "/bye"], max_new_tokens=12,
                              file=HangingUpFile(after=3), endless=True)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
    assert code == 0 and repl.conv.hangup is None
    assert [m["role"] for m in repl.conv.messages] == ["user", "assistant"] * 2
    assert not any(m.get("interrupted") for m in repl.conv.messages)
    assert repl.totals["generated_tokens"] == 24  # both replies ran to max_new_tokens


def test_the_toolbar_reads_the_cache_once_per_step_not_per_keystroke(loaded, monkeypatch):
    """prompt-toolkit redraws the toolbar at every keystroke; the cache's figures come from the device
    (several reads per layer) and only change when a token is fed."""
    from h2ochat.kv import H2OCache

    repl, _, _ = drive(loaded, ["hello there", "/bye"])
    reads = []
    original = H2OCache.layer_stats
    monkeypatch.setattr(H2OCache, "layer_stats", lambda self: reads.append(1) or original(self))
    first = repl.toolbar()
    assert repl.toolbar() == first and len(reads) == 1  # drawn twice, read once
    repl.cmd_cache("")
    assert len(reads) == 1  # /cache uses the same figures
    typed = iter(["more words", "/bye"])
    repl.read_line = lambda prompt: next(typed)
    repl.run()
    reads.clear()
    assert repl.toolbar() != first and len(reads) == 1  # a new step: read again, once
    repl.toolbar()
    assert len(reads) == 1
