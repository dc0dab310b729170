"""A listener whose port is in use fails `python -m minicore serve` fast, end to end: the process
exits non-zero within EXIT_AFTER_ERROR_S of the one line that names the port and the setting to
change, with no traceback and no process left behind. Each test holds the port with a plain socket
(cheaper than a second server): the NIXL side channel of a kv_both instance (the real model: the
side channel is bound after the model load; before the fix its thread died and the server waited
forever), and, on the simulated runner with two DP ranks, the DP group's rendezvous
(--data-parallel-rpc-port) and the engines' handshake (the port after it). The whole run is bounded
too: startup (imports, engine processes, a model load) plus the exit."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from server_helpers import free_port, start_minicore

from minicore.ports import free_port_pair

EXIT_AFTER_ERROR_S = 10.0
# Until the line: the frontend and two engine processes (simulated), or a model load too, on a
# loaded machine.
SIMULATED_STARTUP_S = 60.0
MODEL_STARTUP_S = 150.0
DP_SIMULATED = ["--runner", "simulated", "--data-parallel-size", "2", "--max-model-len", "512",
                "--kv-cache-memory", str(64 << 20)]


def held(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:port, as another server's would be."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def serve_until_exit(args: list[str], startup_s: float) -> tuple[int, list[tuple[float, str]],
                                                                 float]:
    """Run `serve` with args: (its exit code, its output lines with the time each came, the time
    it exited). Killed, and the test failed, if it still runs startup_s + EXIT_AFTER_ERROR_S
    after it started."""
    with tempfile.TemporaryDirectory() as tmp:
        # A FIFO for its output: read line by line as it comes, and at its end once the last
        # process that holds it has exited.
        output = Path(tmp) / "output"
        os.mkfifo(output)
        proc = start_minicore(
            [sys.executable, "-m", "minicore", "serve", "--port", str(free_port()), *args], output)
        lines: list[tuple[float, str]] = []

        def read():
            with open(output, errors="replace") as f:
                for line in f:
                    lines.append((time.monotonic(), line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            returncode = proc.wait(startup_s + EXIT_AFTER_ERROR_S)
            exited = time.monotonic()
            # The FIFO ends when the last process holding it does: no engine outlived the server.
            reader.join(EXIT_AFTER_ERROR_S)
            assert not reader.is_alive(), "a child of the server still runs"
        except subprocess.TimeoutExpired:
            pytest.fail("the server still runs:\n" + "\n".join(line for _, line in lines[-40:]))
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(5)
    return returncode, lines, exited


def assert_fails_fast_with(args: list[str], startup_s: float, message: str) -> None:
    returncode, lines, exited = serve_until_exit(args, startup_s)
    output = "\n".join(line for _, line in lines)
    naming = [(at, line) for at, line in lines if message in line]
    assert returncode != 0, output
    assert len(naming) == 1, output
    after = exited - naming[0][0]
    print(f"exit {after:.2f} s after the line: {naming[0][1]}")
    assert after < EXIT_AFTER_ERROR_S, output
    assert "Traceback" not in output and "Exception in thread" not in output, output


@pytest.mark.model
def test_a_nixl_side_channel_port_in_use_fails_startup_naming_it():
    port = free_port()
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"side_channel_port": port}}
    with held(port):
        assert_fails_fast_with(
            ["--max-model-len", "1024", "--kv-cache-memory", str(256 << 20),
             "--kv-transfer-config", json.dumps(config)], MODEL_STARTUP_S,
            f"kv_connector_extra_config.side_channel_port {port}: address localhost:{port} (the "
            "NIXL side channel) is in use; choose another with "
            "kv_connector_extra_config.side_channel_port in --kv-transfer-config (vLLM: "
            "VLLM_NIXL_SIDE_CHANNEL_PORT)")


def test_a_dp_rendezvous_port_in_use_fails_startup_naming_the_flag():
    port = free_port_pair()
    with held(port):
        assert_fails_fast_with(
            [*DP_SIMULATED, "--data-parallel-rpc-port", str(port)], SIMULATED_STARTUP_S,
            f"--data-parallel-rpc-port {port}: address 127.0.0.1:{port} (DP rank 0's rendezvous) "
            "is in use; choose another with --data-parallel-rpc-port")


def test_a_dp_handshake_port_in_use_fails_startup_naming_the_flag():
    port = free_port_pair()
    with held(port + 1):
        assert_fails_fast_with(
            [*DP_SIMULATED, "--data-parallel-rpc-port", str(port)], SIMULATED_STARTUP_S,
            f"--data-parallel-rpc-port {port}: address 127.0.0.1:{port + 1} (the engines' "
            "handshake) is in use; choose another with --data-parallel-rpc-port")
