"""`h2ochat serve` as a child process on a free loopback port: for the tests and the load benchmark,
which drive a real server the way clients do."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .metrics import parse


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """``h2ochat serve --model MODEL ARGS`` on 127.0.0.1; ``url`` is its base URL, ``log_path`` its output."""

    def __init__(self, model: str, *args: str, log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model, self.log_path = model, Path(log_path)
        command = [sys.executable, "-m", "h2ochat.cli", "serve", "--model", model, "--host", "127.0.0.1",
                   "--port", str(self.port), *args]
        self.command = "h2ochat " + " ".join(command[3:])
        self._log = open(self.log_path, "w")
        environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=environment)

    def get(self, path: str, timeout: float = 30) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def wait_ready(self, timeout: float = 600) -> None:
        """Until /health says 200 (the model is loaded); raises if the process ends or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if self.get("/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not become ready in {timeout:.0f} s:\n{self.log()}")

    def health(self) -> dict:
        return json.loads(self.get("/health")[1])

    def metrics(self) -> dict[str, float]:
        return parse(self.get("/metrics")[1])

    def wait_metrics(self, condition, timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until ``condition(values)`` holds or ``timeout`` passes; the last values."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            if condition(values) or time.monotonic() > deadline:
                return values
            time.sleep(0.05)

    def peak_rss(self) -> int:
        """The process's peak resident memory (Linux), 0 where unknown."""
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def cpu_seconds(self) -> float:
        """CPU time the process has used so far (Linux; user + system), 0 where unknown: a cost that
        does not depend on how busy the machine is."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
