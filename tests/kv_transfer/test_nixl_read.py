"""Two processes, two NIXL agents: the consumer reads a held request's blocks from the producer
with a one-sided READ, the producer learns of it by NIXL's notification, and the bytes are equal
(tests/kv_transfer/nixl_peer.py does each side); a READ from a peer that stopped is cancelled at
the consumer's read_timeout. Also: a NixlConnector without NIXL refuses clearly."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from nixl_peer import LOCAL_BLOCKS

from minicore.ports import free_port_pair

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("nixl_peer.py")
HAS_NIXL = importlib.util.find_spec("nixl") is not None and importlib.util.find_spec(
    "nixl._api") is not None


def _start(role: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(PEER), role, str(port), "engine-p"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_line(proc: subprocess.Popen, expected: str) -> None:
    for line in proc.stdout:
        if line.strip() == expected:
            return
    pytest.fail(f"{proc.args[2]} exited with {proc.wait()} before saying {expected!r}")


@pytest.mark.skipif(not HAS_NIXL, reason="nixl is not installed (scripts/setup.sh installs it)")
def test_two_processes_read_blocks_byte_for_byte():
    port = free_port_pair()
    producer = _start("producer", port)
    try:
        _wait_for_line(producer, "ready")  # the handshake listener is up
        consumer = _start("consumer", port)
        out, _ = consumer.communicate(timeout=45)
        assert consumer.returncode == 0, out
        assert "equal: 4 blocks x 4 layers" in out, out
        # The producer exits 0 only once the READ's notification freed its held request.
        rest, _ = producer.communicate(timeout=30)
        assert producer.returncode == 0, rest
    finally:
        producer.kill()


@pytest.mark.skipif(not HAS_NIXL, reason="nixl is not installed (scripts/setup.sh installs it)")
def test_a_read_from_a_stopped_peer_fails_by_its_deadline():
    """A peer that stops answering (SIGSTOP) after a first read: the second READ usually never
    completes (seen with UCX's default transports and with UCX_TLS=tcp alike), so at read_timeout
    (2 s here) the consumer cancels it and reports its blocks failed (the request then
    recomputes). On a loaded machine the transport has also been seen to fail the READ at once:
    then the blocks fail at once, with the transport's error, never later than the deadline."""
    port = free_port_pair()
    holder, consumer = _start("holder", port), None
    try:
        _wait_for_line(holder, "ready")
        consumer = _start("stalled-consumer", port)
        _wait_for_line(consumer, "read once")
        os.kill(holder.pid, signal.SIGSTOP)
        out, _ = consumer.communicate("go\n", timeout=45)
        assert consumer.returncode == 0, out
        ended = re.search(r"second read ended after ([\d.]+) s, failed blocks \[(.*)\]", out)
        assert ended, out
        assert float(ended[1]) < 10, out
        cancelled = "not done within read_timeout 2 s, cancelled" in out
        assert (float(ended[1]) >= 2) == cancelled and (cancelled or "failed (ERR" in out), out
        assert [int(b) for b in ended[2].split(", ")] == sorted(LOCAL_BLOCKS)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        for proc in (holder, consumer):
            if proc is not None:
                proc.kill()
                proc.wait()


def test_the_worker_refuses_without_nixl(monkeypatch):
    from minicore.kv_transfer import nixl_worker

    monkeypatch.setitem(sys.modules, "nixl._api", None)  # import then raises ImportError
    monkeypatch.setitem(sys.modules, "nixl", None)
    with pytest.raises(RuntimeError, match="NIXL is not installed.*pip install nixl-cu12"):
        nixl_worker._import_nixl()


def test_the_agents_progress_thread_pauses_between_polls(monkeypatch):
    """nixl_agent would start it with pthrDelay 0: a core spun by an idle engine."""
    _api = pytest.importorskip("nixl._api")
    from minicore.kv_transfer import nixl_worker

    made = []

    def record(name, agent_config):
        made.append(agent_config.pthrDelay)
        raise RuntimeError("stop before a real agent starts")

    monkeypatch.setattr(_api.nixlBind, "nixlAgent", record)
    nixl_agent, nixl_agent_config = nixl_worker._import_nixl()
    with pytest.raises(RuntimeError, match="stop before"):
        nixl_agent("probe", nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    assert made == [nixl_worker.PROGRESS_THREAD_DELAY_US] and made[0] > 0
    assert _api.nixlBind.nixlAgent is record  # put back as it was
