"""A newcomer's trial: 40 bad or unusual inputs to the command line and the server, each with the
verdict it must get. None may give a traceback, hang, lose what the user wrote, or have a request
field ignored without a 400 (docs/openai-fields.md says which fields are ignored by design, and why).

    PYTHONPATH=. python benchmarks/newcomer_trial.py [--out benchmarks/newcomer_trial.json]

The model is a tiny random Llama written by the tests' own helper (tests/checkpoints.py), so the
trial runs in a few minutes on a laptop CPU and needs no download. Each case records its command or
request, what came back (exit status and the error line, or the HTTP status and the error's param),
and whether that is the verdict expected; the run exits 1 if any case is not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from json_report import write

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
TIMEOUT_S = 240  # a case still running after this is a hang


def h2ochat(*args: str, stdin: bytes | str = b"", cwd: Path | None = None) -> subprocess.CompletedProcess:
    data = stdin.encode("utf-8", "surrogateescape") if isinstance(stdin, str) else stdin
    env = {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run([sys.executable, "-m", "h2ochat.cli", *args], input=data, capture_output=True,
                              timeout=TIMEOUT_S, cwd=cwd, env=env)
    except subprocess.TimeoutExpired as expired:
        return subprocess.CompletedProcess(args, "hang", expired.stdout or b"", expired.stderr or b"")


def text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def cli_verdict(result, want: str, needle: str | None = None, check=None) -> tuple[bool, str]:
    """``want``: "error" (exit 2, exactly one `h2ochat: error:` line, no traceback) or "ok" (exit 0)."""
    err, out = text(result.stderr), text(result.stdout)
    errors = [line for line in err.splitlines() if line.startswith("h2ochat: error:")]
    lines = [line for line in (out + err).splitlines() if line.strip() and "Loading weights" not in line]
    said = errors[0] if errors else next((line for line in lines if needle and needle in line), lines[-1] if lines else "")
    if result.returncode == "hang":
        return False, "hang"
    if "Traceback" in err or "Traceback" in out:
        return False, "traceback: " + err[-300:]
    if want == "error":
        good = result.returncode == 2 and len(errors) == 1 and (needle is None or needle in errors[0])
    else:
        good = result.returncode == 0 and (needle is None or needle in out + err)
    if check is not None and good:
        good = check(result)
    return good, f"exit {result.returncode}: {said[:300]}"


def as_markdown(record: dict) -> str:
    """The results as a table: case, input, verdict expected, what came back, pass."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")[:220]

    rows = [f"| {n} | {cell(r['case'])} | `{cell(r['input'])}` | {cell(r['expected'])} | {cell(r['got'])} | "
            f"{'yes' if r['pass'] else '**no**'} |" for n, r in enumerate(record["results"], 1)]
    return (f"# Newcomer trial: {record['passed']} of {record['cases']} inputs got their verdict\n\n"
            "Made by `benchmarks/newcomer_trial.py` (a tiny random Llama; the results in `newcomer_trial.json`).\n\n"
            "| # | case | input | expected | got | pass |\n|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "newcomer_trial.json"))
    options = parser.parse_args()
    from checkpoints import write_checkpoint

    work = Path(tempfile.mkdtemp(prefix="h2ochat-trial-"))
    os.environ["H2OCHAT_HOME"] = str(work / "home")
    os.environ["H2OCHAT_CACHE_DIR"] = str(work / "cache")
    model = str(write_checkpoint(work / "tiny"))
    story = work / "story.txt"
    story.write_text("Once upon a time the keeper lit the lamp. " * 20)
    (work / "story-2.txt").write_text("a second story, kept")
    saved = work / "saved.json"
    binary = work / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    cases: list[dict] = []

    def cli(name: str, args: list[str], want: str, needle: str | None = None, stdin: bytes | str = b"", check=None):
        began = time.monotonic()
        result = h2ochat(*args, stdin=stdin, cwd=work)
        good, said = cli_verdict(result, want, needle, check)
        cases.append({"case": name, "input": "h2ochat " + " ".join(args) + (" < stdin" if stdin else ""),
                      "expected": want + (f" naming {needle!r}" if needle else ""), "got": said, "pass": good,
                      "seconds": round(time.monotonic() - began, 1)})
        print(("PASS " if good else "FAIL ") + name + " -> " + said[:160], flush=True)

    m = ["--model", model]
    # -- the command line ----------------------------------------------------------------------------
    cli("empty prompt", ["generate", "", *m], "error", "empty")
    cli("whitespace prompt from stdin", ["generate", "-", *m], "error", "empty", stdin="  \n\t\n")
    cli("zero new tokens", ["generate", "hi", "-n", "0", *m], "error")
    cli("negative new tokens", ["generate", "hi", "-n", "-5", *m], "error")
    cli("temperature nan", ["generate", "hi", "--temperature", "nan", *m], "error")
    cli("top-p 0", ["generate", "hi", "--top-p", "0", *m], "error", "top_p")
    cli("budget 0", ["generate", "hi", "--budget", "0", *m], "error", "--budget")
    cli("budget 1e999", ["generate", "hi", "--budget", "1e999", *m], "error", "--budget")
    cli("prompt file is a folder", ["generate", "--prompt-file", str(work), *m], "error")
    cli("prompt file is binary", ["generate", "--prompt-file", str(binary), *m], "error", "UTF-8")
    cli("prompt file /dev/null", ["generate", "--prompt-file", "/dev/null", *m], "error", "empty")
    cli("empty --model", ["generate", "hi", "--model", ""], "error")
    cli("model is a story file", ["generate", "hi", "--model", str(story)], "error", "is a file, not a model")
    cli("story --out under a file", ["story", "--out", str(story / "x.txt"), "--tokens", "4", *m], "error")
    cli("story --continue missing file", ["story", "--continue", str(work / "missing.txt"), "--tokens", "4", *m],
        "error")
    cli("story --continue binary file", ["story", "--continue", str(binary), "--tokens", "4", *m], "error", "UTF-8")
    cli("story --continue with --out", ["story", "--continue", str(story), "--out", str(work / "o.txt"), *m], "error")
    cli("story -n 3 --out over an existing second file",
        ["story", "-n", "3", "--out", str(work / "story.txt"), "--tokens", "4", *m], "error", "exists")
    cli("eval --text missing", ["eval", "--text", str(work / "nope.txt"), *m], "error")
    cli("bench --context abc", ["bench", "--context", "abc", *m], "error", "--context")
    cli("serve --port 70000", ["serve", "--port", "70000", *m], "error")
    cli("serve --kv-memory 10XB", ["serve", "--kv-memory", "10XB", *m], "error", "--kv-memory")
    cli("serve --max-prompt-tokens -1", ["serve", "--max-prompt-tokens", "-1", *m], "error")
    cli("typo in a command", ["generat", "hi"], "error", "generate")
    cli("history of an unknown id", ["history", "zzzz-no-such"], "error")
    cli("run: /save with no file", ["run", *m, "--no-history"], "ok", "usage: /save FILE", stdin="/save\n")
    cli("run: /load of a missing file", ["run", *m, "--no-history"], "ok", "error:",
        stdin=f"/load {work / 'missing.json'}\n")
    cli("run: /set temperature abc", ["run", *m, "--no-history"], "ok", "temperature", stdin="/set temperature abc\n")
    cli("run: /budget -3", ["run", *m, "--no-history"], "ok", "error:", stdin="/budget -3\n")
    cli("run: a stray byte in a piped line", ["run", *m, "--no-history", "--max-new-tokens", "2"], "ok",
        stdin=b"hello \xff there\n")

    def save_twice_kept(result) -> bool:
        return json.loads(saved.read_text())["messages"][0]["content"] == "first"

    saved.write_text('{"not": "a conversation"}')
    cli("run: /save over a file it did not write, then --force, then again", ["run", *m, "--no-history",
        "--max-new-tokens", "2"], "ok", "exists", stdin=f"first\n/save {saved}\n/save {saved} --force\n/save {saved}\n",
        check=save_twice_kept)
    cli("run: an open block at the end of piped input", ["run", *m, "--no-history", "--max-new-tokens", "2"], "ok",
        "sending what was typed", stdin='"""\nline one\nline two')

    # -- the server ------------------------------------------------------------------------------------
    from h2ochat.serve.process import ServerProcess

    server = ServerProcess(model, "--no-compile", "--max-sequences", "2", "--max-prompt-tokens", "200",
                           log_path=work / "serve.log")
    server.wait_ready(timeout=300)

    def request(name: str, method: str, path: str, body, want: int, param: str | None = None,
                content_type: str = "application/json"):
        data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        began = time.monotonic()
        call = urllib.request.Request(server.url + path, data=data, method=method,
                                      headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(call, timeout=TIMEOUT_S) as response:
                status, answer = response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            status, answer = error.code, error.read().decode()
        except OSError as error:
            status, answer = "no answer", str(error)
        try:
            error = json.loads(answer).get("error") or {}
        except (ValueError, AttributeError):
            error = {}
        good = status == want and (param is None or error.get("param") == param)
        said = f"{status} param={error.get('param')}: {error.get('message', '')[:200]}" if error else f"{status}"
        cases.append({"case": name, "input": f"{method} {path} {(data or b'')[:160].decode('utf-8', 'replace')}",
                      "expected": f"{want}" + (f" naming {param}" if param else ""), "got": said, "pass": good,
                      "seconds": round(time.monotonic() - began, 1)})
        print(("PASS " if good else "FAIL ") + name + " -> " + said[:160], flush=True)

    chat = "/v1/chat/completions"
    base = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    request("messages empty", "POST", chat, {**base, "messages": []}, 400, "messages")
    request("a tool message", "POST", chat, {**base, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages")
    request("n 0", "POST", chat, {**base, "n": 0}, 400, "n")
    request("max_tokens 0", "POST", chat, {**base, "max_tokens": 0}, 400, "max_tokens")
    request("five stop strings", "POST", chat, {**base, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop")
    request("the body is a JSON array", "POST", chat, [base], 400)
    request("text/plain garbage", "POST", chat, b"hello there", 400, content_type="text/plain")
    request("logit_bias key -1", "POST", chat, {**base, "logit_bias": {"-1": 5}}, 400, "logit_bias")
    request("temperature as a string", "POST", chat, {**base, "temperature": "0.5"}, 400, "temperature")
    request("stream as a string", "POST", chat, {**base, "stream": "yes"}, 400, "stream")
    request("token id past the vocabulary", "POST", "/v1/completions",
            {"model": model, "prompt": [1, 2, 10**9], "max_tokens": 2}, 400, "prompt")
    request("seed 1.5", "POST", chat, {**base, "seed": 1.5}, 400, "seed")
    request("an image part", "POST", chat, {**base, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400)
    request("max_tokens 10^12", "POST", chat, {**base, "max_tokens": 10**12}, 400, "max_tokens")
    request("frequency_penalty 3", "POST", chat, {**base, "frequency_penalty": 3}, 400, "frequency_penalty")
    request("a prompt over --max-prompt-tokens", "POST", chat, {**base, "messages": [
        {"role": "user", "content": "word " * 400}]}, 400, "messages")
    request("/v1/embeddings", "POST", "/v1/embeddings", {"model": model, "input": "hi"}, 404)
    request("GET on the chat route", "GET", chat, None, 405)
    request("presence_penalty and logit_bias together are honoured", "POST", chat,
            {**base, "presence_penalty": 1.0, "logit_bias": {"5": 2}}, 200)
    server.stop()
    log = server.log()
    if "Traceback" in log:
        cases.append({"case": "server log", "input": "the server's output", "expected": "no traceback",
                      "got": log[-400:], "pass": False})
    passed = sum(case["pass"] for case in cases)
    record = {"cases": len(cases), "passed": passed, "results": cases}
    write(record, options.out)
    Path(options.out).with_suffix(".md").write_text(as_markdown(record))
    print(f"{passed} of {len(cases)} cases got their verdict")
    sys.exit(0 if passed == len(cases) else 1)


if __name__ == "__main__":
    main()
