"""A real `python -m minicore serve` for the end-to-end tests, started on a free port in its own
session (process group), so that whatever it started is killed at the end whatever happened.

`python -m minicore ...` and `python script.py ...` start from a zygote (start_minicore, and
run_python for subprocess.run's use): a process that has imported minicore, torch and
transformers once, without computing anything, and forks each command (multiprocessing's
forkserver). A fresh interpreter spends about 10 s of CPU on those imports before it does
anything, and the suite starts some 60 servers and 20 other commands (docs/BENCHMARKS.md). The
forked command runs the same main() as `python -m minicore` (or the script as __main__), in a
session of its own, with the test's environment, its output in its log, and the exit status the
interpreter would give."""

import atexit
import json
import multiprocessing
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import httpx
import psutil

from minicore.ports import free_port  # noqa: F401  (the server tests import it from here)

STARTUP_TIMEOUT_S = 180


MINICORE = [sys.executable, "-m", "minicore"]
# Imported by the zygote before it forks anything: everything a server and its forked engines
# import on the way to serving. None of them computes with torch (a forked child of a process that
# did would hang in OpenMP), which test_server_process.py checks.
ZYGOTE_PRELOAD = ["minicore.__main__", "minicore.entrypoints.api_server", "minicore.engine.launch",
                  "minicore.model.runner", "transformers.modeling_utils",
                  "transformers.models.auto.tokenization_auto", "server_helpers"]


def start_minicore(args: list[str], log_path: Path, env: dict[str, str] | None = None,
                   stderr_path: Path | None = None):
    """args (a command line) started in a session of its own, with os.environ and env, its
    output in log_path (its stderr in stderr_path if given): forked by the zygote if it is
    `python -m minicore ...` or `python script.py ...`, else a subprocess.Popen."""
    environ = {**os.environ, **(env or {})}
    if not _forkable(args):
        with open(log_path, "wb") as log, open(stderr_path or os.devnull, "ab") as err:
            return subprocess.Popen(args, stdout=log, start_new_session=True, env=environ,
                                    stderr=err if stderr_path else subprocess.STDOUT)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(ZYGOTE_PRELOAD)
    process = context.Process(target=_run_forked, name="minicore",
                              args=(list(args[1:]), str(log_path), str(stderr_path or log_path),
                                    environ))
    process.start()
    return ForkedProcess(process)


def _forkable(args: list[str]) -> bool:
    return args[:len(MINICORE)] == MINICORE or (
        len(args) > 1 and args[0] == sys.executable and str(args[1]).endswith(".py"))


def run_python(args: list, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """subprocess.run(args, capture_output=True, text=True, timeout=timeout) with os.environ and
    env, for `python -m minicore ...` or `python script.py ...` forked by the zygote."""
    args = [str(a) for a in args]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch()
        err.touch()
        proc = start_minicore(args, out, env, stderr_path=err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
            raise
        return subprocess.CompletedProcess(args, code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def _run_forked(argv: list[str], stdout_path: str, stderr_path: str,
                environ: dict[str, str]) -> None:
    """In the forked child: what `python *argv` does (argv: -m minicore ..., or a script and its
    arguments), then exit as it would."""
    os.setsid()
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        out = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(out, fd)
        os.close(out)
    os.environ.clear()
    os.environ.update(environ)
    code = 0
    try:
        if argv[0] == "-m":
            from minicore.__main__ import main

            sys.argv = ["minicore", *argv[2:]]
            main(argv[2:])
        else:
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except KeyboardInterrupt:  # the interpreter dies of the SIGINT
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


class ForkedProcess:
    """What the tests use of subprocess.Popen, for a process that the zygote forked."""

    def __init__(self, process: multiprocessing.Process):
        self.process, self.pid = process, process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(MINICORE, timeout)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def is_engine(process: psutil.Process) -> bool:
    """An engine process: minicore names them EngineCore_DP<rank> (a forked one has its
    frontend's command line)."""
    return process.name().startswith("EngineCore_DP")


class ServerProcess:
    """Use as a context manager: it returns once /health answers 200; on exit it SIGTERMs the
    server if it still runs and then SIGKILLs its whole process group."""

    def __init__(self, *args: str, port: int | None = None, env: dict[str, str] | None = None):
        # A given port: a server restarted where its clients expect it (the disaggregation tests).
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="minicore-serve-", suffix=".log")[1])
        # float32 unless a test asks otherwise: the servers' outputs are compared with float32
        # references, and --dtype auto would be bfloat16 on a CPU with native bfloat16.
        self.args = [*MINICORE, "serve", "--port", str(self.port),
                     "--disable-uvicorn-access-log", "--dtype", "float32", *args]
        self.env = env
        self.proc: subprocess.Popen | ForkedProcess | None = None

    def __enter__(self):
        self.proc = start_minicore(self.args, self.log_path, self.env)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(
            f"the server was not healthy within {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def engine_processes(self) -> list[psutil.Process]:
        return [p for p in self.children() if is_engine(p)]

    def engine_process(self) -> psutil.Process:
        (engine,) = self.engine_processes()
        return engine

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of ours still alive
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        self.log_path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------
# For the hostile-input tests (test_fuzz.py, test_hostile_input.py): raw JSON requests and checks.


def json_body(body) -> bytes:
    """body as a real client sends it: ASCII JSON, so a lone surrogate goes over the wire as the
    escape \\ud800 (valid JSON; Python's json decodes it back to the lone surrogate)."""
    return json.dumps(body, ensure_ascii=True, allow_nan=False).encode()


def post_json(http: httpx.Client, path: str, body, **kwargs) -> httpx.Response:
    return http.post(path, content=json_body(body), headers={"Content-Type": "application/json"},
                     **kwargs)


def check_openai_error(response: httpx.Response, status: int) -> dict:
    """Assert response is an OpenAI error body {"error": {message, type, param, code}} with this
    status; return its "error" object."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict), body
    assert {"message", "type", "param", "code"} <= set(error), body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] == status, body
    return error


ENGINE_STATE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                       "vllm:kv_cache_usage_perc")


def engine_state(http: httpx.Client, model_name: str, engine: str = "0") -> dict[str, float]:
    """The engine-state gauges of /metrics (running, waiting, KV cache usage) for one engine;
    a gauge that is missing reads as None."""
    want = sorted([f'model_name="{model_name}"', f'engine="{engine}"'])
    values = dict.fromkeys(ENGINE_STATE_GAUGES)
    for line in http.get("/metrics").text.splitlines():
        name, _, rest = line.partition("{")
        if name in values and sorted(rest[:rest.index("}")].split(",")) == want:
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


async def stream_events(http: httpx.AsyncClient, body: dict, started, headers=None) -> list[dict]:
    """Stream a completion; set `started` (an asyncio.Event) at its first event; return all its
    events."""
    events = []
    async with http.stream("POST", "/v1/completions", headers=headers,
                           json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                started.set()
    return events


def seconds_until_closed(socks: list[socket.socket], limit_s: float) -> list[float]:
    """For each socket, the seconds until the server closed it (EOF or reset; inf if it is
    still open after limit_s)."""
    t0 = time.monotonic()
    closed = {}
    with selectors.DefaultSelector() as selector:
        for s in socks:
            selector.register(s, selectors.EVENT_READ)
        while len(closed) < len(socks) and time.monotonic() - t0 < limit_s:
            for key, _ in selector.select(timeout=0.1):
                try:
                    data = key.fileobj.recv(4096)
                except ConnectionError:
                    data = b""
                if not data:
                    closed[key.fileobj] = time.monotonic() - t0
                    selector.unregister(key.fileobj)
    return [closed.get(s, float("inf")) for s in socks]
