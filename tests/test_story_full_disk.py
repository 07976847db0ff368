"""A story file that fails late (issue 31, item 5): /dev/full takes the open and refuses the first
flush, as a disk that fills mid-story does. One line says which file and why, the exit is non-zero,
there is no traceback, and the story is on standard output (streamed, or in the JSON record) exactly
as the library writes it."""

from __future__ import annotations

import json
import os

import pytest

from test_story import SHORT, as_text, checkpoint, loaded, reference_tokens, story  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.usefixtures("seed"),
              pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")]


def assert_one_line(stderr: str) -> None:
    last = stderr.strip().splitlines()[-1]
    assert "Traceback" not in stderr
    assert last == "h2ochat: error: could not write /dev/full: No space left on device " + last.split("device ", 1)[1]


def test_a_streamed_story_to_a_full_disk_is_one_line_and_kept_on_stdout(checkpoint, loaded, seed):  # noqa: F811
    result = story(checkpoint, "--prompt", SHORT, "--tokens", "20", "--out", "/dev/full", "--seed", str(seed))
    assert result.exit_code != 0
    assert_one_line(result.stderr)
    assert "standard output" in result.stderr.strip().splitlines()[-1]
    assert result.stdout.startswith(SHORT + as_text(loaded.tokenizer, reference_tokens(loaded, SHORT, 20, seed)))


def test_a_json_story_to_a_full_disk_keeps_its_text_in_the_record(checkpoint, loaded, seed):  # noqa: F811
    result = story(checkpoint, "--prompt", SHORT, "--tokens", "20", "--out", "/dev/full", "--seed", str(seed), "--json")
    assert result.exit_code != 0
    assert_one_line(result.stderr)
    record = json.loads(result.stdout)
    assert record["stories"][0]["text"] == as_text(loaded.tokenizer, reference_tokens(loaded, SHORT, 20, seed))
