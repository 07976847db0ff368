"""`generate` with a long prompt (issue 31, item 9): the prompt's reading is reported between prefill
chunks (standard error only: standard output stays the reply's), and a Ctrl-C during it says how far
it got and that nothing was generated. The Ctrl-C is a KeyboardInterrupt raised from the progress
callback, after a chosen chunk."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from h2ochat.chat import prompt_progress
from h2ochat.cli import app
from h2ochat.errors import EXIT_INTERRUPTED

pytestmark = pytest.mark.usefixtures("seed")
CHUNK = 16
PROMPT = "the quick brown fox jumps over the lazy dog " * 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("progress-llama"), max_position_embeddings=512)


def generate(checkpoint, *args):
    result = CliRunner().invoke(app, ["generate", PROMPT, "--model", str(checkpoint), "--dtype", "float32", "--raw",
                                      "--budget", "24",
                                      "--prefill-chunk", str(CHUNK), "-n", "3", "--ignore-eos", *args])
    return result.exit_code, result.stdout, result.stderr


def recording(monkeypatch, stop_at: int | None = None) -> list[int]:
    seen: list[int] = []
    update = prompt_progress.PromptProgress.update

    def record(self, read: int) -> None:
        seen.append(read)
        update(self, read)
        if stop_at is not None and read >= stop_at:
            raise KeyboardInterrupt

    monkeypatch.setattr(prompt_progress.PromptProgress, "update", record)
    return seen


@pytest.mark.parametrize("as_json", [False, True])
def test_the_reading_is_reported_chunk_by_chunk_off_standard_output(checkpoint, monkeypatch, as_json):
    seen = recording(monkeypatch)
    code, out, err = generate(checkpoint, *(["--json"] if as_json else []))
    assert code == 0, err
    total = seen[-1]
    assert total > 4 * CHUNK
    reading = [read for read in seen if read < total]
    assert reading == list(range(CHUNK, total, CHUNK))  # between chunks, none skipped (no re-numbering at 24)
    assert "reading the prompt" not in out and "stopped" not in err


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_during_the_prompt_says_how_far_it_read(checkpoint, monkeypatch, as_json):
    everything = recording(monkeypatch)
    code, _, err = generate(checkpoint)
    assert code == 0, err
    total = everything[-1]
    monkeypatch.undo()
    recording(monkeypatch, stop_at=3 * CHUNK)
    code, out, err = generate(checkpoint, *(["--json"] if as_json else []))
    assert code == EXIT_INTERRUPTED
    assert err.strip().splitlines()[-1] == (f"stopped during the prompt, {3 * CHUNK} of {total} tokens read; "
                                            "nothing generated")
    assert "Traceback" not in err
    if as_json:
        assert '"interrupted": true' in out


def test_ctrl_c_after_the_prompt_says_what_was_generated(checkpoint, monkeypatch):
    progress = prompt_progress.PromptProgress
    steps = []
    should_stop = progress.should_stop

    def stop_before_the_first_decode_step(self) -> bool:
        should_stop(self)
        if not self.reading:
            steps.append(1)
            if len(steps) == 1:  # the first token came from the prompt's logits, before any decode step
                raise KeyboardInterrupt
        return False

    monkeypatch.setattr(progress, "should_stop", stop_before_the_first_decode_step)
    code, _, err = generate(checkpoint)
    assert code == EXIT_INTERRUPTED
    assert err.strip().splitlines()[-1] == "stopped after 1 generated token"
