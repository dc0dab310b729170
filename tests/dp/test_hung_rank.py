"""A hung engine (issue 24, item 11): alive, so no process watch sees it, but it sends nothing.

The frontend's EngineWatchdog (minicore/dp/coordinator.py) pings an engine that has been quiet for
a quarter of MINICORE_ENGINE_ITERATION_TIMEOUT_S and declares it hung when the ping goes unanswered
for the whole timeout: /health turns 503 and every request in flight fails at once, instead of
hanging until gloo's timeout (300 s) with DP, or for ever without.

- The watchdog alone, on a fake clock of real sleeps: an engine that answers is spared however long
  it is idle; one that does not is declared within [timeout, 1.5 timeout]; frames waiting to be
  read (the frontend's loop behind) defer the verdict; the setting is checked at startup.
- A DP=2 server (simulated runner, a 2 s timeout) whose rank 0 is SIGSTOPped while it runs only
  dummy batches in the wave of rank 1's stream: it sends no frames even when well, yet /health
  turns 503 and the stream fails within the bound; resumed, both ranks stop.
- An idle DP=2 server with the same timeout stays healthy well past it, before and after a wave.
- One engine alone, SIGSTOPped mid-stream: the stream fails within the bound.
"""

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest
from dp_helpers import dp_client, free_port_pair
from server_helpers import ServerProcess, stream_events

from minicore.config import create_engine_config
from minicore.dp.coordinator import (
    DEFAULT_ITERATION_TIMEOUT_S,
    ITERATION_TIMEOUT_ENV,
    EngineWatchdog,
    NoWatchdog,
    make_watchdog,
)
from minicore.engine.core_client import EngineDeadError
from minicore.model.config import SimulatedCost
from minicore.sampling_params import SamplingParams

TIMEOUT_S = 2.0
# A hang is declared within 1.5 timeouts; the rest is slack for a loaded 2-core machine.
DETECT_S = 1.5 * TIMEOUT_S + 1.5
SIMULATED_DP2 = ["--runner", "simulated", "--simulated-cost", '{"step_s": 0.01}',
                 "--data-parallel-size", "2"]
RANK = "X-data-parallel-rank"


# ------------------------------------------------------------------ the watchdog alone


class Engines:
    """Fake engines for a watchdog: those in `answering` answer each ping after 10 ms."""

    def __init__(self, answering: set[int], timeout_s: float = 0.4, pending: bool = False):
        self.answering = answering
        self.pending = pending
        self.pings: list[int] = []
        self.verdicts: list[str] = []
        self.watchdog = EngineWatchdog(2, timeout_s, self.ping, lambda: self.pending,
                                       self.verdicts.append)

    def ping(self, engine: int) -> None:
        self.pings.append(engine)
        if engine in self.answering:
            asyncio.get_running_loop().call_later(0.01, self.answer, engine)

    def answer(self, engine: int) -> None:
        self.watchdog.last_frame[engine] = time.monotonic()


async def test_watchdog_pings_quiet_engines_and_spares_those_that_answer():
    engines = Engines(answering={0, 1})
    engines.watchdog.start()
    try:
        await asyncio.sleep(2.0)  # five timeouts of silence but for the answers
    finally:
        engines.watchdog.stop()
    assert engines.verdicts == []
    # Each is pinged again a quarter-timeout (or a tick more) after its last answer.
    assert engines.pings.count(0) >= 4 and engines.pings.count(1) >= 4, engines.pings


async def test_watchdog_declares_an_engine_that_does_not_answer_within_the_bound():
    engines = Engines(answering={0})
    start = time.monotonic()
    engines.watchdog.start()
    while not engines.verdicts and time.monotonic() - start < 5:
        await asyncio.sleep(0.005)
    elapsed = time.monotonic() - start
    assert engines.verdicts == [
        f"engine core 1 made no progress for 0.4 s: it sent nothing, not even the answer to a "
        f"ping (hung? {ITERATION_TIMEOUT_ENV}=0.4)"]
    # Pinged after a quarter of the timeout, declared a timeout later (and a tick or two; the
    # rest is slack for a loaded machine).
    assert 0.5 <= elapsed <= 0.4 * 1.5 + 0.3, elapsed
    assert engines.pings.count(1) == 1
    await asyncio.sleep(0.5)
    assert len(engines.verdicts) == 1, "the watch went on after its verdict"


async def test_watchdog_waits_while_frames_are_pending_to_be_read():
    engines = Engines(answering=set(), pending=True)
    engines.watchdog.start()
    try:
        await asyncio.sleep(1.2)
        assert engines.verdicts == []
        engines.pending = False
        deadline = time.monotonic() + 1
        while not engines.verdicts and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
    finally:
        engines.watchdog.stop()
    (verdict,) = engines.verdicts
    # Both silent: both named, as in a DP wave where the others wait for the hung one.
    assert verdict.startswith("engine cores 0, 1 made no progress for 1.")
    assert "one hung, the others waiting for it in a collective?" in verdict


def test_watchdog_setting(monkeypatch):
    def make():
        return make_watchdog(2, print, bool, print)

    monkeypatch.delenv(ITERATION_TIMEOUT_ENV, raising=False)
    assert make().timeout_s == DEFAULT_ITERATION_TIMEOUT_S == 60
    monkeypatch.setenv(ITERATION_TIMEOUT_ENV, "2.5")
    assert make().timeout_s == 2.5
    monkeypatch.setenv(ITERATION_TIMEOUT_ENV, "0")
    assert isinstance(make(), NoWatchdog)
    for bad in ("soon", "-1", "nan", "inf", ""):
        monkeypatch.setenv(ITERATION_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"{ITERATION_TIMEOUT_ENV} must be a number"):
            make()


# ------------------------------------------------------------------ a DP server


def _rank0(server: ServerProcess, rpc_port: int) -> psutil.Process:
    """Rank 0's engine process: the one that hosts the DP group's store on the rpc port."""
    (rank0,) = [p for p in server.engine_processes()
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == rpc_port
                       for c in p.net_connections("tcp"))]
    return rank0


LONG_STREAM = {"prompt": "Go on and on.", "max_tokens": 1000, "ignore_eos": True}


async def _health(http: httpx.AsyncClient) -> int:
    return (await http.get("/health")).status_code


async def test_sigstopped_dp_rank_turns_health_503_and_fails_the_stream(monkeypatch):
    monkeypatch.setenv(ITERATION_TIMEOUT_ENV, str(TIMEOUT_S))
    rpc_port = free_port_pair()
    with ServerProcess(*SIMULATED_DP2, "--data-parallel-rpc-port", str(rpc_port)) as server:
        engines = server.engine_processes()
        rank0 = _rank0(server, rpc_port)
        # Forked before the frontend bound anything: no engine holds its handshake port.
        assert not [c for e in engines for c in e.net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr.port == rpc_port + 1]
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http, \
                asyncio.timeout(60):
            started = asyncio.Event()
            stream = asyncio.create_task(stream_events(http, LONG_STREAM, started, {RANK: "1"}))
            await asyncio.wait_for(started.wait(), 20)
            # Rank 0 holds no request: it runs dummy batches for rank 1's wave, sending nothing.
            rank0.suspend()
            stopped = time.monotonic()
            try:
                while await _health(http) == 200:
                    assert time.monotonic() - stopped < DETECT_S, "/health stayed 200"
                    await asyncio.sleep(0.05)
                detected = time.monotonic() - stopped
                assert await _health(http) == 503
                events = await asyncio.wait_for(stream, 2)
                refused = await http.post("/v1/completions",
                                          json={"prompt": "hi", "max_tokens": 2})
            finally:
                rank0.resume()
            print(f"hung rank noticed {detected:.2f} s after SIGSTOP (timeout {TIMEOUT_S} s)")
            assert len(events) > 1 and all(e["choices"][0]["finish_reason"] is None
                                           for e in events[:-1]), events[-2:]
            error = events[-1]["error"]
            assert error["code"] == 503
            assert "made no progress for 2." in error["message"], error
            assert "not even the answer to a ping" in error["message"], error
            assert refused.status_code == 503
            # Resumed, the ranks take the frontend's SIGTERM; the server stays up to say 503.
            _, alive = await asyncio.to_thread(psutil.wait_procs, engines, 15)
            assert not alive, f"engines outlived the verdict: {alive}"
            assert server.proc.poll() is None


async def test_idle_dp_server_stays_healthy_past_the_bound(monkeypatch):
    monkeypatch.setenv(ITERATION_TIMEOUT_ENV, str(TIMEOUT_S))
    with ServerProcess(*SIMULATED_DP2, "--data-parallel-rpc-port",
                       str(free_port_pair())) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http, \
                asyncio.timeout(60):
            # A wave runs and ends; then nothing is asked of the engines but the pings.
            response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert response.status_code == 200
            quiet_until = time.monotonic() + 2.5 * TIMEOUT_S
            while time.monotonic() < quiet_until:
                assert await _health(http) == 200
                await asyncio.sleep(0.25)
            response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert response.status_code == 200


# ------------------------------------------------------------------ one engine


async def test_sigstopped_single_engine_fails_its_stream_within_the_bound(monkeypatch):
    monkeypatch.setenv(ITERATION_TIMEOUT_ENV, str(TIMEOUT_S))
    config = create_engine_config(runner="simulated", simulated_cost=SimulatedCost(step_s=0.005))
    async with dp_client(config) as client, asyncio.timeout(30):
        stream = client.generate([3, 4], SamplingParams(max_tokens=2000, ignore_eos=True), "s")
        await anext(stream)
        pid = client.engine_core.procs[0].pid
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(EngineDeadError, match=r"engine core 0 made no progress for 2\."):
                async for _ in stream:
                    pass
            detected = time.monotonic() - stopped
        finally:
            os.kill(pid, signal.SIGCONT)
        print(f"hung engine noticed {detected:.2f} s after SIGSTOP (timeout {TIMEOUT_S} s)")
        assert detected <= DETECT_S, detected
        assert not client.is_healthy
