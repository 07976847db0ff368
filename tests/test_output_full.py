"""Standard output that cannot take more (`> /dev/full`): one line on stderr and exit 1, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")]


@pytest.mark.parametrize("command", [["models"], ["history"]])
def test_a_full_standard_output_is_one_line(command, tmp_path):
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "h2ochat.cli", *command], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, env={**os.environ, "H2OCHAT_CACHE_DIR": str(tmp_path),
                                                           "HOME": str(tmp_path)})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["h2ochat: error: could not write the output: No space left on device"]
