"""Issue 24, the server treats no client as trusted, end to end against a real `python -m minicore
serve` (SIMULATED runner): a body over the limit is a 413 before it is parsed, a long prompt is
tokenized off the event loop (other clients are answered meanwhile), a connection that sends
nothing, or sends a request too slowly, is closed within its stated bound, even when there are
more of them than the server may open files, and a --port in use is a one-line error at once.

One server serves the module, with short timeouts (1 s with no request, 3 s to send one) so that
the tests are fast, and an open-file limit of FD_LIMIT so that running out of files is cheap.
"""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from server_helpers import ServerProcess, check_openai_error, seconds_until_closed

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 256
KEEP_ALIVE_S = 1.0
READ_S = 3.0
FD_LIMIT = 512
ARGS = ["--runner", "simulated", "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory", str(16 << 20), "--timeout-keep-alive", str(KEEP_ALIVE_S),
        "--timeout-request-read", str(READ_S)]
BODY_LIMIT = 1 << 20  # the default at this max_model_len: the 1 MiB floor
# How late past its bound a connection may be closed (a busy machine, the polling).
SLACK_S = 1.5
SMALL = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux) to bound the server's open files")
    process = ServerProcess(*ARGS)
    # prlimit runs the server (exec) with soft and hard limits of FD_LIMIT open files.
    process.args = ["prlimit", f"--nofile={FD_LIMIT}", *process.args]
    with process:
        yield process


def _assert_serving(url: str) -> None:
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json=SMALL)
        assert r.status_code == 200, r.text[:500]


# --------------------------------------------------------------------------- bodies and prompts


async def _while_probing(url: str, request) -> tuple[float, dict[str, list[float]]]:
    """Run request() while other connections ask /health and a small completion (token ids: no
    tokenizing) again and again; return how long request() took and each path's latencies."""
    latencies: dict[str, list[float]] = {"/health": [], "/v1/completions": []}
    done = asyncio.Event()

    async def probe(path: str, body) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while not done.is_set():
                t0 = time.monotonic()
                r = await (http.post(path, json=body) if body else http.get(path))
                latencies[path].append(time.monotonic() - t0)
                assert r.status_code == 200, r.text[:500]
                await asyncio.sleep(0.01)

    probes = [asyncio.create_task(probe("/health", None)),
              asyncio.create_task(probe("/v1/completions", SMALL))]
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    try:
        await request()
    finally:
        elapsed = time.monotonic() - t0
        done.set()
        await asyncio.gather(*probes)
    return elapsed, latencies


def _prompt_body(num_bytes: int) -> bytes:
    """A completion request of about num_bytes, its prompt plain words."""
    text = "hello world " * (num_bytes // 12)
    return json.dumps({"model": MODEL, "prompt": text, "max_tokens": 4}).encode()


async def test_a_50_mb_prompt_is_refused_before_parsing_and_others_are_served_meanwhile(server):
    """The issue's 50 MB prompt (once 38 s of tokenizing on the event loop, every client waiting):
    a 413 naming the limit and its flag, read but never parsed, in about the time it takes to
    send; the probes on other connections stay prompt."""
    body = _prompt_body(50_000_000)  # encoded here, not while the probes are timed
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        async def request():
            r = await http.post("/v1/completions", content=body, headers=JSON)
            error = check_openai_error(r, 413)
            assert f"limit of {BODY_LIMIT}" in error["message"], error
            assert "--max-request-body-bytes" in error["message"], error

        elapsed, latencies = await _while_probing(server.url, request)
        # The connection stays usable: the refused body was read to its end.
        assert (await http.post("/v1/completions", json=SMALL)).status_code == 200
    assert elapsed < READ_S
    every = sorted(latencies["/health"] + latencies["/v1/completions"])
    assert every[-1] < 1.0, every[-5:]


async def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """A prompt just under the body limit (about 170,000 tokens, a second or so of tokenizing):
    the 400 naming the context length comes after it is tokenized, and meanwhile the probes are
    answered as if nothing were running (before the fix each waited for the whole tokenizing)."""
    body = _prompt_body(BODY_LIMIT - 1000)

    async def request():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            r = await http.post("/v1/completions", content=body, headers=JSON)
        error = check_openai_error(r, 400)
        assert error["param"] == "prompt" and "maximum context length" in error["message"]

    elapsed, latencies = await _while_probing(server.url, request)
    # /health touches only the event loop: the measure of its being free. A completion also waits
    # for a forward on a CPU the tokenizing thread shares, so it need only keep being served.
    health = sorted(latencies["/health"])
    assert len(health) >= 4 and len(latencies["/v1/completions"]) >= 2, (elapsed, latencies)
    assert health[-1] < max(0.25, elapsed / 3), (elapsed, health[-5:])


def test_a_chunked_body_over_the_limit_is_refused(server):
    """No Content-Length: the body is counted as it comes, and refused once past the limit."""
    chunks = (b"x" * 65536 for _ in range(BODY_LIMIT // 65536 + 2))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/completions", content=chunks, headers=JSON)
    check_openai_error(r, 413)
    _assert_serving(server.url)


def test_too_many_headers_are_refused(server):
    headers = {f"x-filler-{i}": "1" for i in range(300)}
    with httpx.Client(base_url=server.url, timeout=10) as http:
        error = check_openai_error(http.get("/health", headers=headers), 431)
    assert "--h11-max-header-count" in error["message"]


# ---------------------------------------------------------------------------------- connections


def test_a_silent_connection_is_closed_within_the_keep_alive_bound(server):
    """A connection that never sends a byte (uvicorn kept it for ever): closed after
    --timeout-keep-alive."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        (after,) = seconds_until_closed([s], KEEP_ALIVE_S + SLACK_S)
    assert KEEP_ALIVE_S - 0.2 < after < KEEP_ALIVE_S + SLACK_S, after
    _assert_serving(server.url)


def test_a_request_sent_slowly_is_closed_at_the_read_deadline(server):
    """A request head that never ends, a byte every 0.25 s (each byte restarted uvicorn's
    keep-alive timer): closed --timeout-request-read after its first byte."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        while time.monotonic() - t0 < READ_S + SLACK_S:
            try:
                s.sendall(b"a")
            except ConnectionError:
                break
            if seconds_until_closed([s], 0.25) != [float("inf")]:
                break
        after = time.monotonic() - t0
    assert READ_S - 0.3 < after < READ_S + SLACK_S, after
    _assert_serving(server.url)


def test_more_silent_connections_than_open_files_do_not_lock_clients_out(server):
    """The issue's lock-out, scaled down: more silent connections than the server may open
    files. Those past the limit are refused at once, the rest closed within the keep-alive
    bound, and then the server serves again."""
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(FD_LIMIT + 50)]
    try:
        closed = seconds_until_closed(socks, KEEP_ALIVE_S + SLACK_S)
    finally:
        for s in socks:
            s.close()
    assert max(closed) < KEEP_ALIVE_S + SLACK_S, max(closed)
    _assert_serving(server.url)


# ------------------------------------------------------------------------------ the port in use


def test_a_port_in_use_is_one_line_at_once_and_no_engine_starts():
    """--port held by another socket: exit status 1 within seconds, one line naming the port and
    the flag, no traceback, and no engine process started (the port is bound first)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "minicore", "serve", "--port", str(port), *ARGS],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=10)
        finally:
            proc.kill()
        elapsed = time.monotonic() - t0
    assert proc.returncode == 1, (out, err)
    assert elapsed < 10
    lines = [line for line in err.splitlines() if f":{port}" in line]
    assert len(lines) == 1 and "--port" in lines[0] and "in use" in lines[0], err
    assert "Traceback" not in err and "EngineCore" not in out + err, err
    left = [p for p in psutil.process_iter() if _group(p) == proc.pid]
    assert not left, left


def _group(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except OSError:
        return None
