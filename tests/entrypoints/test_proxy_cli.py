"""`python -m minicore proxy` on the command line: --help, missing or malformed instance URLs
refused, a silent connection closed at the server's keep-alive deadline, and SIGTERM ending it
with exit status 0."""

import signal
import socket
import subprocess
import sys
import time

import httpx
from server_helpers import free_port, seconds_until_closed


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minicore", "proxy", *args],
                          capture_output=True, text=True, timeout=60, **kwargs)


def test_cli_help_and_missing_instances():
    assert "--prefill" in _cli("--help").stdout
    for args in (["--prefill", "http://a:1"], ["--decode", "http://a:1"]):
        result = _cli(*args)
        assert result.returncode == 2 and "required" in result.stderr
    result = _cli("--prefill", "a:1", "--decode", "http://a:1")
    assert result.returncode == 1 and "http://" in result.stderr


def test_cli_proxy_exits_0_on_sigterm():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minicore", "proxy", "--port", str(port),
                             "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        # A connection that sends nothing is closed at the server's keep-alive deadline (5 s),
        # not held until the proxy has no file descriptor left for real clients.
        with socket.create_connection(("127.0.0.1", port)) as silent:
            (after,) = seconds_until_closed([silent], 10)
        assert 4.5 < after < 8, after
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
