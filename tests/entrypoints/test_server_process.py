"""The server as a process: a dead engine fails in-flight requests fast and turns /health to 503;
SIGTERM, and Ctrl+C on the whole process group, end the server within seconds, its streams
finishing as "abort", with no child left, no traceback and one log format. The engine runs the
SIMULATED runner (made-up tokens every 20 ms): what matters here is the processes, not the model,
and each of these tests needs a server of its own."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import pytest
from server_helpers import ServerProcess, free_port, run_python, stream_events

SIMULATED = ["--runner", "simulated", "--simulated-cost", '{"step_s": 0.02}',
             "--max-model-len", "1024", "--kv-cache-memory", str(64 << 20)]
LONG = {"prompt": "Tell me everything.", "max_tokens": 900, "ignore_eos": True}
FAIL_FAST_S = 5.0
# vLLM's log line: (process pid=N) LEVEL MM-DD HH:MM:SS [file.py:line] message
VLLM_LOG_LINE = re.compile(r"\((APIServer|EngineCore_DP\d+|Proxy) pid=\d+\) "
                           r"(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d "
                           r"\[[\w.]+\.py:\d+\] ")
SIGTERM_EXIT_S = 5.0


async def test_engine_death_fails_requests_fast_and_health_turns_503():
    with ServerProcess(*SIMULATED) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, \
                asyncio.timeout(60):
            started = asyncio.Event()
            stream = asyncio.create_task(stream_events(http, LONG, started))
            whole = asyncio.create_task(http.post("/v1/completions", json=LONG))
            await started.wait()
            await asyncio.sleep(0.2)  # the non-streamed one is in the engine too
            assert (await http.get("/health")).status_code == 200

            server.engine_process().kill()
            t0 = time.monotonic()
            events, response = await asyncio.gather(stream, whole)
            assert time.monotonic() - t0 < FAIL_FAST_S
            assert events[-1]["error"]["code"] == 503  # the stream ends with an error event
            assert "dead" in events[-1]["error"]["message"]
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "ServiceUnavailableError"

            assert (await http.get("/health")).status_code == 503
            refused = await http.post("/v1/completions", json={"prompt": "hi"})
            assert refused.status_code == 503
            assert server.proc.poll() is None  # the server stays up to say so


async def _signal_mid_stream(server: ServerProcess, send_signal) -> None:
    """send_signal(server) while a stream runs: the server exits 0 within SIGTERM_EXIT_S (uvicorn
    raises the signal again after its graceful shutdown), the request in flight ends with
    finish_reason "abort" (aborted, not cut off), and no process is left behind."""
    children = server.children()
    assert server.engine_processes()
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, asyncio.timeout(60):
        started = asyncio.Event()
        stream = asyncio.create_task(stream_events(http, LONG, started))
        await started.wait()

        send_signal(server)
        t0 = time.monotonic()
        events = await stream
        assert await asyncio.to_thread(server.proc.wait, SIGTERM_EXIT_S) == 0
        assert time.monotonic() - t0 < SIGTERM_EXIT_S
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    _, alive = psutil.wait_procs(children, timeout=2)
    assert not alive, f"left behind: {alive}"


async def test_sigterm_exits_within_seconds_and_leaves_no_process():
    with ServerProcess(*SIMULATED) as server:
        await _signal_mid_stream(server, lambda s: s.proc.send_signal(signal.SIGTERM))


async def test_ctrl_c_on_the_process_group_exits_quietly_and_leaves_no_process():
    """A terminal's Ctrl+C sends SIGINT to the whole process group, engines included: the server
    exits 0 as fast as on SIGTERM, nothing logs a traceback or an error, and every line of the
    log (frontend, engine, uvicorn) is in vLLM's format, naming its process."""
    with ServerProcess(*SIMULATED) as server:
        await _signal_mid_stream(server, lambda s: os.killpg(s.proc.pid, signal.SIGINT))
        log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert " ERROR " not in log, log
    lines = [line for line in log.splitlines() if line.strip()]
    for line in lines:
        assert VLLM_LOG_LINE.match(line), line
    assert any(line.startswith("(APIServer pid=") for line in lines), log
    assert any(line.startswith("(EngineCore_DP0 pid=") for line in lines), log
    assert any("Initializing a minicore engine with config: " in line
               and "max_seq_len=1024" in line for line in lines), log
    assert any("Uvicorn running on" in line and line.startswith("(APIServer") for line in lines)


def test_ctrl_c_ends_the_proxy_quietly_in_the_same_log_format():
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "minicore", "proxy", "--port", str(port),
             "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while httpx_health(f"http://127.0.0.1:{port}/health") != 200:
                assert proc.poll() is None and time.monotonic() < deadline, "no proxy"
                time.sleep(0.1)
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(SIGTERM_EXIT_S) == 0
        finally:
            proc.kill()
            proc.wait()
        log.seek(0)
        text = log.read()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines and all(VLLM_LOG_LINE.match(line) for line in lines), text
    assert any("Shutting down" in line for line in lines), text


def httpx_health(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


def test_an_engine_config_error_at_start_is_one_line_not_a_traceback():
    """A KV cache too small for max_model_len (here auto: the model's 8192) is refused by the
    engine as it starts: one error line naming both numbers, exit status 1."""
    small = ["--runner", "simulated", "--max-model-len", "auto", "--kv-cache-memory", "1M"]
    done = run_python([sys.executable, "-m", "minicore", "serve", "--port", str(free_port()),
                       *small])
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert re.search(r"EngineCore failed to start: the KV cache has room for \d+ blocks, but one "
                     r"request of max_model_len \(8192\)", done.stderr), done.stderr
    assert "max_model_len auto: 8192" in done.stderr


def test_a_served_engine_is_forked_and_frees_the_port_when_its_frontend_is_killed():
    """`serve` forks its engines (they start with the frontend's imports), and a forked engine
    does not hold the server's port: with the frontend SIGKILLed, a new server binds the port
    while the orphaned engine is still there, and the engine then stops by itself."""
    with ServerProcess(*SIMULATED) as server:
        engine = server.engine_process()
        assert engine.cmdline() == psutil.Process(server.proc.pid).cmdline()  # forked, not spawned
        assert engine.ppid() == server.proc.pid
        assert not [c for c in engine.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        server.proc.kill()
        server.proc.wait(5)
        assert engine.is_running()
        with ServerProcess(*SIMULATED, port=server.port) as again:
            assert httpx.get(again.url + "/health").status_code == 200
        engine.wait(10)


ZYGOTE_CHILD = """
import importlib, multiprocessing, sys
import server_helpers
for name in server_helpers.ZYGOTE_PRELOAD:
    importlib.import_module(name)
{before_fork}
def child():
    import torch
    torch.set_num_threads(2)
    assert (torch.ones(512, 512) @ torch.ones(512, 512)).sum() > 0  # a parallel region
process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join(10)
if process.exitcode is None:  # hung
    process.kill()
    sys.exit(3)
sys.exit(process.exitcode)
"""
A_PRODUCT = "import torch; torch.ones(512, 512) @ torch.ones(512, 512)"


@pytest.mark.parametrize("before_fork, works", [("", True), (A_PRODUCT, False)])
def test_the_zygote_computes_nothing_so_that_its_forks_can(before_fork, works):
    """The zygote that forks the tests' servers imports ZYGOTE_PRELOAD and nothing else: a child
    forked after that runs torch on two threads, where a child forked after a single product
    on two threads hangs in OpenMP (the case that shows the check can fail)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", ZYGOTE_CHILD.format(before_fork=before_fork)],
                          env=env, timeout=120, capture_output=True, text=True)
    assert done.returncode == (0 if works else 3), done.stderr
