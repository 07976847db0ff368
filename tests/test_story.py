"""`h2ochat story`: past the budget and the position limit in flat memory, continuing a story of any
length, N stories in one batch, the repetition figure, and failing early on a bad --out."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

import h2ochat_prompts
from h2ochat.cli import app
from h2ochat.commands.story_rows import tell
from h2ochat.engine.detokenize import TextStream
from h2ochat.engine.generation import CacheSettings, Sampling
from h2ochat.loading.models import load
from h2ochat.chat.prompting import encode

from seeds import fresh, seed  # noqa: F401  (fixture)
from test_repetition import distinct_reference

pytestmark = pytest.mark.usefixtures("seed")
runner = CliRunner()
SHORT = "once upon a time there was a dragon"  # fits in the repetition window: read by `stream` whole
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from checkpoints import write_checkpoint

    fresh("model")
    return write_checkpoint(tmp_path_factory.mktemp("story-llama"))


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load(str(checkpoint), device="cpu", dtype="float32")


def kv_bytes(slots: int, rows: int = 1) -> int:
    return LAYERS * KV_HEADS * slots * HEAD_DIM * 2 * 4 * rows  # keys + values, fp32


def story(checkpoint, *args, env=None):
    return runner.invoke(app, ["story", "--model", str(checkpoint), "--dtype", "float32", "--budget", "16", *args],
                         env={"NO_COLOR": "1", **(env or {})})


def reference_tokens(loaded, text: str, tokens: int, seed: int, **sampling) -> list[int]:
    """The library's continuation of ``text`` with the story command's default sampling."""
    from h2ochat.engine.generation import inference_steps
    from h2ochat.engine.generation import stream

    settings = dict(temperature=0.8, top_p=0.95, seed=seed, repetition_penalty=1.1, repeat_last_n=64)
    settings.update(sampling)
    cache = CacheSettings(budget="16").build(loaded.model)
    ids = encode(loaded.tokenizer, text, chat=False)
    return [int(s.tokens[0]) for s in inference_steps(stream(loaded.model, cache, ids, max_new_tokens=tokens,
                                                                      sampling=Sampling(**settings)))]


def as_text(tokenizer, ids: list[int]) -> str:
    """Token ids as the story command writes them: piece by piece (random byte soup decodes differently
    whole, where a piece holds back an incomplete character)."""
    pieces = TextStream(tokenizer)
    return "".join(pieces.push(i) for i in ids)


def test_story_goes_past_the_position_limit_in_flat_memory(loaded, seed):
    limit = loaded.model.config.max_position_embeddings
    cache = CacheSettings(budget="16").build(loaded.model)
    opening = loaded.tokenizer(h2ochat_prompts.read("fox", "story"), return_tensors="pt").input_ids[:, :20]
    memory, pieces = [], []
    tokens = 3 * limit
    for piece in tell(loaded.model, loaded.tokenizer, cache, opening, tokens=tokens,
                      sampling=Sampling(temperature=1.0, seed=seed)):
        pieces.append(piece)
        memory.append(cache.kv_bytes())
    assert len(pieces) == tokens  # no stop ids: it keeps going
    assert cache.longest_row_tokens() == 20 + tokens - 1 > 2 * limit
    assert cache.compactions >= 2
    assert set(memory) == {kv_bytes(16)}  # allocated once, never grown
    assert all(stats.held == 16 for stats in cache.layer_stats())


def test_story_file_holds_the_opening_and_the_models_continuation(checkpoint, loaded, tmp_path, seed):
    out = tmp_path / "story.txt"
    result = story(checkpoint, "--prompt", SHORT, "--tokens", "90", "--out", str(out), "--seed", str(seed))
    assert result.exit_code == 0, result.output
    expected = reference_tokens(loaded, SHORT, 90, seed)
    continuation = as_text(loaded.tokenizer, expected)
    assert out.read_bytes().decode() == SHORT + continuation  # nothing of the tool's own after it
    assert result.stdout.startswith(SHORT + continuation)
    summary = result.stderr.strip().splitlines()[-1]
    prompt_tokens = encode(loaded.tokenizer, SHORT, chat=False).shape[1]
    assert summary.startswith("90 tokens in ")
    assert "16 slots per layer and KV head (8 heavy + 8 recent): KV 8.00 KiB in use of 8.00 KiB reserved" in summary
    assert kv_bytes(16) == 8 * 1024
    assert f"{prompt_tokens + 90 - 1} tokens seen" in summary
    # 90 tokens: too few for two windows of 1000, so its two halves, never a stretch against itself
    first, last = distinct_reference(expected[:45], 4), distinct_reference(expected[45:], 4)
    assert f"distinct 4-grams {first:.2f} in the first 45 tokens, {last:.2f} in the last 45 (its two halves" in summary
    assert not re.search(r"\x1b\[", result.output)  # piped: plain text, no progress bar


def test_n_stories_run_as_one_batch_each_with_its_own_stream(checkpoint, loaded, tmp_path, seed):
    out = tmp_path / "tale.txt"
    result = story(checkpoint, "--prompt", SHORT, "--tokens", "40", "-n", "3", "--out", str(out), "--seed", str(seed),
                   "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    texts = []
    for k in range(1, 4):  # story k draws from seed + k - 1, as a single story with that seed does
        expected = as_text(loaded.tokenizer, reference_tokens(loaded, SHORT, 40, seed + k - 1))
        assert (tmp_path / f"tale-{k}.txt").read_bytes().decode() == SHORT + expected
        assert record["stories"][k - 1]["text"] == expected and record["stories"][k - 1]["file"].endswith(f"tale-{k}.txt")
        texts.append(expected)
    assert len(set(texts)) == 3
    assert not out.exists()
    assert record["generated_tokens"] == 120 and record["kv_bytes"] == kv_bytes(16, rows=3)
    assert record["decode_tokens_per_s"] > 0
    assert "3 stories, 120 tokens in" in result.stderr and "(all stories together)" in result.stderr


def test_continue_appends_to_a_story_far_longer_than_the_window(checkpoint, loaded, tmp_path, seed):
    words = "the quick brown fox jumps over the lazy dog once upon a time there was a dragon".split()
    text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (400,)))  # ~10x the 64 positions
    path = tmp_path / "long.txt"
    path.write_text(text + "\n\n")
    result = story(checkpoint, "--continue", str(path), "--tokens", "12", "--seed", str(seed), "--json",
                   "--prefill-chunk", "40")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    written = path.read_bytes().decode()
    appended = record["stories"][0]["text"]
    # the user's bytes stay, trailing blank lines included; the continuation follows them, its own
    # leading whitespace dropped (the file's stands in for it)
    assert written == text + "\n\n" + appended and appended == appended.lstrip()
    read = encode(loaded.tokenizer, text, chat=False).shape[1]
    assert read > 10 * 64 and record["prompt_tokens"] == read
    assert record["tokens_seen"] == read + 12 - 1 and record["kv_bytes"] == kv_bytes(16)
    assert "appended to" in result.stderr and f"read {read} tokens" in result.stderr


def test_continue_reads_a_short_story_like_a_new_one(checkpoint, loaded, tmp_path, seed):
    path = tmp_path / "short.txt"
    path.write_text(SHORT)
    result = story(checkpoint, "--continue", str(path), "--tokens", "30", "--seed", str(seed))
    assert result.exit_code == 0, result.output
    expected = as_text(loaded.tokenizer, reference_tokens(loaded, SHORT, 30, seed))
    assert path.read_bytes().decode() == SHORT + expected
    assert result.stdout.strip() == expected.strip()  # a pipe gets the new text only


@pytest.mark.parametrize("target, count, message", [("missing-dir/story.txt", "1", "no such directory"),
                                                     ("missing-dir/story.txt", "3", "no such directory"),
                                                     ("", "1", "is a directory")])
def test_an_unwritable_out_fails_before_the_model_loads(checkpoint, tmp_path, monkeypatch, target, count, message):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr("h2ochat.commands.story.load", no_loading)
    result = story(checkpoint, "--out", str(tmp_path / target), "-n", count)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("h2ochat: error:") and message in lines[0]


def _no_loading(*args, **kwargs):
    raise AssertionError("the model was loaded before --out was checked")


@pytest.mark.parametrize("target", ["/sys/story.txt", "/proc/story.txt"])
def test_an_out_the_permission_bits_allow_but_the_system_refuses_fails_before_loading(checkpoint, monkeypatch,
                                                                                        target):
    """As root, os.access says /sys and /proc are writable; creating a file there fails all the same."""
    from pathlib import Path

    if not Path(target).parent.is_dir():
        pytest.skip(f"no {Path(target).parent} here")
    try:
        open(target, "ab").close()
        pytest.skip(f"{target} can be written here")
    except OSError:
        pass
    monkeypatch.setattr("h2ochat.commands.story.load", _no_loading)
    result = story(checkpoint, "--tokens", "5", "--out", target)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"h2ochat: error: cannot write {target}")


def test_checking_out_leaves_no_file_behind_and_an_existing_one_as_it_was(tmp_path):
    from h2ochat.commands.story_files import check_writable

    new, old = tmp_path / "new.txt", tmp_path / "old.txt"
    old.write_bytes(b"kept as it is")
    check_writable(new)
    check_writable(old)
    assert not new.exists() and old.read_bytes() == b"kept as it is"


def test_a_continued_story_joins_the_text_as_written(checkpoint, loaded, tmp_path, monkeypatch):
    """`story --out F` then `story --continue F`: the continuation follows the story's last word,
    with no line break the first run put there of its own (the model is scripted to write words)."""
    import h2ochat.engine.generation as generation

    words = loaded.tokenizer(" and the dragon flew", add_special_tokens=False).input_ids
    calls = []

    def scripted(logits, sampling, generator=None, seen=None):
        calls.append(1)
        return torch.full((logits.shape[0],), words[(len(calls) - 1) % len(words)])

    monkeypatch.setattr(generation, "sample", scripted)
    path = tmp_path / "story.txt"
    tokens = str(len(words))
    assert story(checkpoint, "--prompt", SHORT, "--tokens", tokens, "--out", str(path)).exit_code == 0
    assert path.read_bytes().decode() == SHORT + " and the dragon flew"
    calls.clear()
    result = story(checkpoint, "--continue", str(path), "--tokens", tokens)
    assert result.exit_code == 0, result.output
    assert path.read_bytes().decode() == SHORT + " and the dragon flew and the dragon flew"


def test_continue_of_a_missing_file_is_one_line(checkpoint, tmp_path):
    result = story(checkpoint, "--continue", str(tmp_path / "nothing.txt"))
    assert result.exit_code == 2 and result.output.startswith("h2ochat: error: no such file")


def test_stop_at_eos_stops_at_an_end_of_turn_marker_too(checkpoint, loaded, monkeypatch):
    """--stop-at-eos uses the same stop rule as run and generate: <|end|> ends the story."""
    import h2ochat.engine.generation as generation

    end = loaded.tokenizer.convert_tokens_to_ids("<|end|>")
    plain = 50  # an ordinary byte-level token
    assert end != loaded.tokenizer.eos_token_id
    calls = []

    def scripted(logits, sampling, generator=None, seen=None):
        calls.append(1)
        return torch.full((logits.shape[0],), end if len(calls) == 4 else plain)

    monkeypatch.setattr(generation, "sample", scripted)
    result = story(checkpoint, "--prompt", SHORT, "--tokens", "20", "--stop-at-eos", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["generated_tokens"] == 3 and len(calls) == 4
    assert json.loads(story(checkpoint, "--prompt", SHORT, "--tokens", "20", "--json").stdout)["generated_tokens"] == 20


def test_a_terminal_gets_progress_of_tokens_rate_and_time_left(checkpoint, monkeypatch):
    import io

    from rich.console import Console

    screens = {"err": io.StringIO(), "out": io.StringIO()}

    def terminal(stderr=False, file=None):
        return Console(file=screens["err" if stderr else "out"], force_terminal=True, width=120)

    monkeypatch.setattr("h2ochat.commands.story.make_console", terminal)
    result = story(checkpoint, "--prompt", SHORT, "--tokens", "30", "-n", "2")
    assert result.exit_code == 0, result.output
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screens["err"].getvalue())
    assert "writing 2 stories" in drawn and "/60 tok" in drawn and "tok/s" in drawn


def test_prompt_files_resolve_by_name_and_path(tmp_path):
    assert set(h2ochat_prompts.names("story")) >= {"lighthouse", "fox"}
    assert len(h2ochat_prompts.names("system")) >= 2
    own = tmp_path / "mine.txt"
    own.write_text("It was a dark night.\n")
    assert h2ochat_prompts.read(str(own)) == "It was a dark night."
    assert h2ochat_prompts.read("story-fox.txt") == h2ochat_prompts.read("fox")
    assert h2ochat_prompts.system_prompt("concise").startswith("You are")
    assert h2ochat_prompts.system_prompt("Speak French.") == "Speak French."


# -- continuing only appends (issue 15, item 3) ----------------------------------------------------------
SHAKESPEARE = "/work/shared/data/tinyshakespeare.txt"


@pytest.fixture
def shakespeare(tmp_path):
    """The first 20,000 bytes of Tiny Shakespeare: they end in "So, " (a trailing space)."""
    from pathlib import Path

    source = Path(SHAKESPEARE)
    if not source.is_file():
        pytest.skip(f"{SHAKESPEARE} is not here")
    head = source.read_bytes()[:20000]
    assert head.endswith(b"So, ")
    path = tmp_path / "play.txt"
    path.write_bytes(head)
    return path, head


def test_continue_keeps_every_byte_the_user_wrote(checkpoint, shakespeare, seed):
    path, head = shakespeare
    result = story(checkpoint, "--continue", str(path), "--tokens", "6", "--seed", str(seed), "--json")
    assert result.exit_code == 0, result.output
    written = path.read_bytes()
    appended = json.loads(result.stdout)["stories"][0]["text"]
    assert written.startswith(head)  # "So, " and its space still there
    assert written == head + appended.encode() and appended == appended.lstrip()


def test_continue_that_writes_nothing_leaves_the_file_as_it_was(checkpoint, loaded, shakespeare, monkeypatch):
    import h2ochat.engine.generation as generation

    path, head = shakespeare
    monkeypatch.setattr(generation, "sample", lambda logits, *a, **k: torch.full((logits.shape[0],),
                                                                                 loaded.tokenizer.eos_token_id))
    result = story(checkpoint, "--continue", str(path), "--tokens", "5", "--stop-at-eos", "--prefill-chunk", "2048")
    assert result.exit_code == 0, result.output
    assert path.read_bytes() == head


def test_text_appended_while_the_model_loads_is_kept_and_read(checkpoint, loaded, tmp_path, seed, monkeypatch):
    """The file is read again under its lock once the model is loaded: what another program appended
    meanwhile is neither cut (as a truncation at an offset measured before loading would) nor unread."""
    import h2ochat.commands.story as story_module

    path = tmp_path / "tale.txt"
    path.write_text(SHORT)
    real_load = story_module.load

    def slow_load(*args, **kwargs):
        with path.open("a") as other:
            other.write(" and a knight")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(story_module, "load", slow_load)
    result = story(checkpoint, "--continue", str(path), "--tokens", "5", "--seed", str(seed), "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert path.read_bytes().decode().startswith(SHORT + " and a knight" + record["stories"][0]["text"])  # bytes: a \r stays
    assert record["prompt_tokens"] == encode(loaded.tokenizer, SHORT + " and a knight", chat=False).shape[1]


def test_the_story_file_is_locked_while_the_continuation_is_written(checkpoint, loaded, tmp_path, monkeypatch):
    import h2ochat.engine.generation as generation
    from h2ochat.commands.story_files import appending
    from h2ochat.errors import UserError

    path = tmp_path / "tale.txt"
    path.write_text(SHORT)
    refused = []
    real_sample = generation.sample

    def sample_and_try_to_append(*args, **kwargs):
        try:
            with appending(path):
                refused.append(False)
        except UserError as exc:
            refused.append("another h2ochat story" in str(exc))
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(generation, "sample", sample_and_try_to_append)
    result = story(checkpoint, "--continue", str(path), "--tokens", "3")
    assert result.exit_code == 0, result.output
    assert refused == [True, True, True]
    with appending(path):  # and released at the end
        pass


# -- bursts: one host read per k tokens on an accelerator ---------------------------------------------------
def test_tokens_are_read_back_once_per_burst():
    from torch.overrides import TorchFunctionMode

    from h2ochat.commands.story_rows import read_in_bursts
    from h2ochat.engine.generation import Step

    class CountReads(TorchFunctionMode):
        reads = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("tolist", "item", "__int__", "__bool__", "__index__"):
                CountReads.reads += 1
            return func(*args, **(kwargs or {}))

    tokens = torch.randint(0, 100, (10, 2))
    steps = [Step(tokens=tokens[i], index=i, elapsed_s=0.0) for i in range(10)]
    with CountReads():
        bursts = list(read_in_bursts(iter(steps), 4))
    assert CountReads.reads == 3  # 4 + 4 + 2 tokens
    assert [len(b) for b in bursts] == [4, 4, 2] and sum(bursts, []) == tokens.tolist()


@pytest.mark.parametrize("stop_at_eos", [False, True])
def test_a_story_read_in_bursts_is_the_same_story(checkpoint, loaded, tmp_path, seed, monkeypatch, stop_at_eos):
    """On an accelerator (here: the CPU told to act like one) the tokens come back four at a time; the
    story, its file and its count are those of the token-by-token run."""
    # (the command imports its generation functions when it runs: they are replaced where they live)
    monkeypatch.setattr("h2ochat.engine.generation.stop_check_interval", lambda device: 4)
    out = tmp_path / "story.txt"
    args = ["--stop-at-eos"] if stop_at_eos else []
    result = story(checkpoint, "--prompt", SHORT, "--tokens", "30", "--out", str(out), "--seed", str(seed), *args)
    assert result.exit_code == 0, result.output
    expected = as_text(loaded.tokenizer, reference_tokens(loaded, SHORT, 30, seed))
    if not stop_at_eos:  # a random model may draw its eos: then the story is a prefix of the reference
        assert out.read_bytes().decode() == SHORT + expected
    else:
        assert (SHORT + expected).startswith(out.read_bytes().decode())
    assert " tok/s" in result.stderr


@pytest.mark.parametrize("every", [1, 4])
def test_a_story_batch_feeds_no_row_past_its_end(checkpoint, loaded, monkeypatch, every):
    """`-n 3 --stop-at-eos`, the rows drawing eos at different steps (read back token by token, and
    in bursts of 4 as on an accelerator): each finished row's cache holds its opening and its story
    up to the eos (never fed), nothing the other rows went on to generate."""
    import h2ochat.engine.generation as generation

    eos, plain = loaded.tokenizer.eos_token_id, 50
    ends = [2, 5, None]  # the step each row draws eos at (None: never)
    calls, caches = [], []

    def scripted(logits, sampling, generator=None, seen=None):
        step = len(calls)
        calls.append(1)
        return torch.tensor([eos if end is not None and step >= end else plain for end in ends])

    real_stream = generation.stream

    def keep_cache(model, cache, *args, **kwargs):
        caches.append(cache)
        return real_stream(model, cache, *args, **kwargs)

    monkeypatch.setattr(generation, "sample", scripted)
    monkeypatch.setattr(generation, "stream", keep_cache)
    monkeypatch.setattr(generation, "stop_check_interval", lambda device: every)
    result = story(checkpoint, "--prompt", SHORT, "--tokens", "12", "-n", "3", "--stop-at-eos", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert [s["generated_tokens"] for s in record["stories"]] == [2, 5, 12]
    opening = record["prompt_tokens"]  # one opening, read by every row
    fed = caches[0].tokens_fed.tolist()
    assert fed == [opening + 2, opening + 5, opening + 11]  # the last token (eos or the 12th) is never fed
