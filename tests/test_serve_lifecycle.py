"""`h2ochat serve` starting and stopping as an operator sees it, on a live process: a signal ends the
running streams with an error event and [DONE] and exits 130 (SIGINT) or 0 (SIGTERM); an address it
cannot listen on, or a KV memory that holds no row, is one line before the model loads; Ctrl-C while
the model loads exits 130 at once; each finished request is one line on stderr (none with --quiet).
No run may print a traceback or abort."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest

from h2ochat.engine.generation import CacheSettings
from h2ochat.loading.models import load
from h2ochat.serve.app import _deliver_to
from h2ochat.serve.backend import ModelBackend
from h2ochat.serve.parked import ParkedStore
from h2ochat.serve.errors import shutting_down
from h2ochat.serve.process import ServerProcess
from h2ochat.serve.scheduler import Scheduler
from h2ochat.serve.server import ServeConfig, choose_rows, row_bytes_before_loading

from seeds import fresh
from serve_fakes import FakeBackend, make_request
from serve_harness import clean_checkpoint, running

ROWS = ("--budget", "16", "--max-sequences", "2", "--prefill-chunk", "8", "--no-compile")  # (eager: see serve_harness)
LONG = 100_000  # tokens a held stream asks for: it runs until the server stops it
BROKEN = ("Traceback", "terminate called", "Aborted", "Exception in thread", "graceful shutdown")
REQUEST_LINE = re.compile(r"request (\S+): prompt=(\d+) cached=(\d+) generated=(\d+) evicted=(\d+) "
                          r"time=(\d+\.\d\d)s finish=(\S+)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    fresh("serve-lifecycle-model")
    return clean_checkpoint(tmp_path_factory.mktemp("lifecycle-llama"), max_position_embeddings=1024)


def serve_once(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``h2ochat serve ARGS`` to its end (for the runs that must not get as far as serving)."""
    return subprocess.run([sys.executable, "-m", "h2ochat.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def assert_clean(output: str) -> None:
    for sign in BROKEN:
        assert sign not in output, output


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, the last line ``h2ochat: error: ...`` holding every fragment, nothing loaded or listening."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert_clean(output)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("h2ochat: error: "), output
    for fragment in fragments:
        assert fragment in last, last
    assert "listening on" not in output and "loaded on" not in output, output
    return last


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# -- item 3: a signal while streams run --------------------------------------------------------------

def test_stopping_fails_every_request_once_running_prefilling_or_waiting():
    scheduler = Scheduler(FakeBackend(rows=3, chunk=2))
    running, choices, reading, waiting = (make_request([5, 6], max_tokens=50), make_request([7], max_tokens=50, n=2),
                                          make_request(list(range(4, 30)), max_tokens=5), make_request([8]))
    for request in (running, choices):
        scheduler.submit(request)
    while scheduler.rows_in_use < 3:
        scheduler.step()
    scheduler.submit(reading)
    scheduler.step()  # its first chunk: being prefilled
    scheduler.submit(waiting)
    scheduler.fail_all(shutting_down())
    for request in (running, choices, reading, waiting):
        assert [event for event in request.events if event[0] in ("error", "done")] == [("error", request.events[-1][1])]
        assert request.events[-1][1].code == "server_shutting_down" and request.finished
    assert scheduler.idle and scheduler.rows_in_use == 0


def test_an_event_for_a_loop_that_has_closed_is_dropped_not_raised_in_the_engine_thread():
    loop = asyncio.new_event_loop()
    events: asyncio.Queue = asyncio.Queue()
    deliver = _deliver_to(loop, events)
    deliver(("text", 0, "a"))
    loop.run_until_complete(asyncio.sleep(0))
    assert events.get_nowait() == ("text", 0, "a")
    loop.close()
    deliver(("text", 0, "b"))  # was: RuntimeError: Event loop is closed, in thread h2ochat-engine
    assert events.empty()


def hold_stream(server: ServerProcess, events: list[str], started: threading.Event) -> None:
    """A completion stream that would run for LONG tokens: its lines into ``events`` until it ends."""
    body = {"model": server.model, "prompt": "the quick brown fox", "max_tokens": LONG, "stream": True,
            "ignore_eos": True, "temperature": 0}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    if len(events) >= 3:
                        started.set()
    except httpx.HTTPError as exc:  # a stream cut short: recorded, and the test says so
        events.append(f"cut: {type(exc).__name__}")
    finally:
        started.set()


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_running_streams_with_an_error_then_done_and_exits_cleanly(checkpoint, tmp_path, sig, status):
    server = ServerProcess(str(checkpoint), *ROWS, "--max-tokens", str(LONG), log_path=tmp_path / "server.log")
    try:
        server.wait_ready(timeout=180)
        streams = [([], threading.Event()) for _ in range(2)]  # both rows busy
        threads = [threading.Thread(target=hold_stream, args=(server, events, started)) for events, started in streams]
        for thread in threads:
            thread.start()
        for _, started in streams:
            assert started.wait(60)
        waiting = {}  # a whole (non-streamed) request queued behind them: a 503 in the OpenAI shape
        body = {"model": server.model, "prompt": "hello", "max_tokens": 4}
        queued = threading.Thread(target=lambda: waiting.update(
            response=httpx.post(server.url + "/v1/completions", json=body, timeout=60)))
        queued.start()
        wait_for(lambda: server.metrics()["requests_waiting"] == 1, 20, "the queued request")
        server.process.send_signal(sig)
        exit_status = server.process.wait(timeout=30)
        for thread in (*threads, queued):
            thread.join(timeout=30)
    finally:
        server.stop()
    log = server.log()
    assert exit_status == status, log
    assert_clean(log)
    for events, _ in streams:
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        assert all(json.loads(e.removeprefix("data: "))["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert waiting["response"].status_code == 503
    assert waiting["response"].json()["error"]["code"] == "server_shutting_down"


# -- item 4: where it cannot listen, and Ctrl-C while loading ----------------------------------------

def test_a_port_in_use_is_one_line_before_the_model_loads(checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve_once("--model", str(checkpoint), "--host", "127.0.0.1", "--port", str(port), *ROWS)
    last = assert_one_line_error(result, f"cannot listen on 127.0.0.1:{port}", "--port")
    assert "in use" in last.lower() or "another process" in last


def test_a_host_that_does_not_resolve_is_one_line_with_its_own_hint(checkpoint):
    result = serve_once("--model", str(checkpoint), "--host", "not.a.host.invalid", "--port", "0", *ROWS)
    last = assert_one_line_error(result, "not.a.host.invalid", "--host")
    assert "port" not in last.split("not.a.host.invalid", 1)[1], last  # not the port-in-use hint


def test_listening_is_said_once_bound_and_names_the_port_bound(checkpoint, tmp_path):
    with running(checkpoint, *ROWS, log_dir=tmp_path) as server:
        log = server.log()
        assert f"listening on http://127.0.0.1:{server.port} " in log
        assert log.index("listening on") < log.index("loaded on")


def test_ctrl_c_while_the_model_loads_exits_130_at_once(checkpoint, tmp_path):
    """The weights file is a FIFO nobody writes: loading blocks in it for as long as the test likes."""
    folder = tmp_path / "slow-model"
    shutil.copytree(checkpoint, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    os.mkfifo(folder / "model.safetensors")
    server = ServerProcess(str(folder), *ROWS, log_path=tmp_path / "server.log")
    try:
        wait_for(lambda: "listening on" in server.log() or server.process.poll() is not None, 120, "listening")
        time.sleep(0.5)  # the engine thread is in the load
        assert server.process.poll() is None and server.get("/health", timeout=5)[0] == 503
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        exit_status = server.process.wait(timeout=30)
        took = time.monotonic() - signalled
    finally:
        server.stop()
    log = server.log()
    assert exit_status == 130, log
    assert took < 8, f"{took:.1f} s to stop"  # it does not wait for the load (it waited 10 s, then aborted)
    assert_clean(log)
    assert log.strip().splitlines()[-1] == "h2ochat serve: stopped while the model was loading", log


# -- item 12: a KV memory that holds no row --------------------------------------------------------

def test_a_kv_memory_that_holds_no_row_is_refused_before_loading(checkpoint):
    result = serve_once("--model", str(checkpoint), "--budget", "16", "--kv-memory", "1KiB", "--port", "0")
    assert_one_line_error(result, "--kv-memory 1.00 KiB holds no sequence row", "KiB")


def test_the_row_bytes_known_before_loading_are_the_loaded_rows_bytes(checkpoint):
    settings = CacheSettings(policy="h2o", budget="16")
    config = ServeConfig(model=str(checkpoint), settings=settings, device="cpu", dtype="float32", kv_memory=1 << 30,
                         prefill_chunk=8)
    loaded = load(str(checkpoint), "cpu", "float32")
    row_bytes = ModelBackend(loaded.model, settings, 1, store=ParkedStore(0), prefill_chunk=8).row_bytes()
    assert row_bytes_before_loading(config) == row_bytes
    # what a model without a configuration at hand gets once loaded: the same refusal
    with pytest.raises(ValueError, match="holds no sequence row"):
        choose_rows(ServeConfig(model="x", settings=settings, kv_memory=row_bytes - 1), row_bytes, "cpu")
    assert choose_rows(ServeConfig(model="x", settings=settings, kv_memory=3 * row_bytes), row_bytes, "cpu")[0] == 3


@pytest.mark.parametrize("skip_special", [True, False], ids=["text-shown", "special-tokens-shown"])
def test_a_reply_holding_a_special_token_resumes_whatever_text_the_client_was_sent(checkpoint, tmp_path, skip_special):
    """With ``ignore_eos`` the random model writes an end-of-turn token mid-reply. The client sends back the
    text it got (without that token by default): the next turn still resumes the parked conversation (it
    was read afresh, the whole history again, when the parked text held the token's text)."""
    with running(checkpoint, *ROWS, "--parked-bytes", "1MiB", log_dir=tmp_path) as server:
        chat = [{"role": "user", "content": "once upon a time"}]
        first = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                           json={"model": server.model, "messages": chat, "max_tokens": 20, "ignore_eos": True,
                                 "temperature": 0, "skip_special_tokens": skip_special}).json()
        reply = first["choices"][0]["message"]
        assert ("<|" in reply["content"]) != skip_special  # (the token is there: shown or not)
        chat += [reply, {"role": "user", "content": "the dragon"}]
        second = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                            json={"model": server.model, "messages": chat, "max_tokens": 4, "temperature": 0}).json()
    fed_before = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == fed_before


# -- item 20: one line per request --------------------------------------------------------------------

def request_lines(log: str) -> dict[str, tuple]:
    return {match[1]: match.groups()[1:] for match in REQUEST_LINE.finditer(log)}


@pytest.mark.parametrize("quiet", [False, True], ids=["logged", "quiet"])
def test_each_finished_request_is_one_line_on_stderr(checkpoint, tmp_path, quiet):
    args = (*ROWS, "--parked-bytes", "1MiB") + (("--quiet",) if quiet else ())
    with running(checkpoint, *args, log_dir=tmp_path) as server:
        chat = [{"role": "user", "content": "once upon a time"}]
        # ignore_eos lets the random model write an end-of-turn token mid-reply: kept in the text
        # (skip_special_tokens false), the history sent back is what the model read, and resumes
        first = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                           json={"model": server.model, "messages": chat, "max_tokens": 20, "ignore_eos": True,
                                 "temperature": 0, "skip_special_tokens": False}).json()
        chat += [first["choices"][0]["message"], {"role": "user", "content": "the dragon"}]
        second = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                            json={"model": server.model, "messages": chat, "max_tokens": 6, "ignore_eos": True,
                                  "temperature": 0, "n": 2}).json()
        body = {"model": server.model, "prompt": "the lazy dog", "max_tokens": 4000, "stream": True,
                "ignore_eos": True}  # closed after its first event: cancelled
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            stream_id = json.loads(next(line for line in response.iter_lines() if line).removeprefix("data: "))["id"]
        if not quiet:  # the closed stream is cancelled at the engine's next step
            wait_for(lambda: stream_id in request_lines(server.log()), 20, "the cancelled request's line")
        log = server.log()
    lines = request_lines(log)
    if quiet:
        assert not lines and "request " not in log and "listening on" in log, log
        return
    assert len(lines) == 3, log
    for reply, reasons in ((first, "length"), (second, "length,length")):
        usage = reply["usage"]
        prompt, cached, generated, evicted, seconds, finish = lines[reply["id"]]
        assert (int(prompt), int(cached), int(generated), int(evicted)) == (
            usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"],
            usage["evicted_tokens"])
        assert float(seconds) >= 0 and finish == reasons
    assert int(lines[second["id"]][1]) > 0 and int(lines[first["id"]][3]) > 0  # resumed; evicted past 16 slots
    assert lines[stream_id][-1] == "cancelled"
