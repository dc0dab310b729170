"""Data parallelism end to end: real `python -m minicore serve` processes with several engines.

- DP=2 on the real default model: a burst of greedy completions spread over both engines gives
  exactly the offline LLM's text; the wave ends when the work does, and a later burst wakes it.
- Headless: a frontend with rank 0 and a `--headless` command with rank 1 serve together; the
  headless command stops by itself when the frontend goes away.
- A rank killed with SIGKILL: every in-flight stream ends with an error, /health turns 503, and the
  surviving rank is stopped instead of waiting forever in a collective.
- The same with expert parallelism, the killed rank a headless one: the frontend cannot see a
  remote process die, so it is the surviving rank, failing in its next forward's collective, that
  reports it (ENGINE_CORE_DEAD and exit 1), within the same bounds.
Every wait is bounded and every process is killed at the end, whatever happened.
"""

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import psutil
import pytest
from dp_helpers import free_port_pair
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MINICORE, STARTUP_TIMEOUT_S, ServerProcess, is_engine, start_minicore

from minicore.llm import LLM
from minicore.sampling_params import SamplingParams

MAX_MODEL_LEN = 512
SMALL = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(64 << 20)]
# The simulated runner allocates no KV cache: its default (nominal) size never preempts here.
SIMULATED = ["--runner", "simulated"]
MAX_TOKENS = 12
RANK = "X-data-parallel-rank"
# Generous bounds: this machine has 2 cores shared with other work.
IDLE_TIMEOUT_S = 30
EXIT_TIMEOUT_S = 15
FAIL_FAST_S = 5

SUBJECTS = ["France", "Japan", "Brazil", "Kenya", "Canada"]
TEMPLATES = ["The capital of {} is", "Write one sentence about {}:",
             "Q: What language is spoken in {}?\nA:", "A famous dish from {} is",
             "{} is a country that", "The flag of {} has the colours",
             "Count: 1 2 3 4 5. The people of {} say", "Three facts about {}:\n1."]
PROMPTS = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
assert len(set(PROMPTS)) == 40


# ------------------------------------------------------------------ helpers


async def _metrics(http: httpx.AsyncClient) -> dict[tuple[str, str], float]:
    """/metrics as {(sample name, engine label): value}, summed over the other labels."""
    response = await http.get("/metrics")
    assert response.status_code == 200
    values = defaultdict(float)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[sample.name, sample.labels.get("engine")] += sample.value
    return values


def _successes(metrics, engine: str) -> float:
    return metrics["vllm:request_success_total", engine]


async def _poll(condition, timeout: float, what: str, interval: float = 0.1) -> None:
    """Await condition() (a coroutine function) until it is true; AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(interval)


async def _engines_idle(http: httpx.AsyncClient) -> bool:
    m = await _metrics(http)
    return all(m["vllm:num_requests_running", e] == m["vllm:num_requests_waiting", e] == 0
               for e in ("0", "1"))


def _engines_by_rank(server: ServerProcess, rpc_port: int) -> tuple[psutil.Process, psutil.Process]:
    """(rank 0, rank 1). The engine processes look alike, but rank 0 is the one
    that hosts the DP group's rendezvous (torch's TCPStore) on the rpc port."""
    engines = server.engine_processes()
    assert len(engines) == 2, engines
    hosts = [p for p in engines
             if any(c.status == psutil.CONN_LISTEN and c.laddr.port == rpc_port
                    for c in p.net_connections("tcp"))]
    assert len(hosts) == 1, f"which engine is rank 0? listening on {rpc_port}: {hosts}"
    (rank1,) = [p for p in engines if p.pid != hosts[0].pid]
    return hosts[0], rank1


async def _cpu_quiet(procs: list[psutil.Process], window: float = 1.0) -> bool:
    """True if the processes used under 10% of a core over the window: paused DP ranks wait on
    their input queue, while a running wave keeps stepping (dummy batches included)."""
    before = sum(sum(p.cpu_times()[:2]) for p in procs)
    await asyncio.sleep(window)
    return sum(sum(p.cpu_times()[:2]) for p in procs) - before < 0.1 * window


async def _complete(http: httpx.AsyncClient, prompt: str, **headers) -> dict:
    response = await http.post("/v1/completions", headers=headers, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


# ------------------------------------------------------------------ DP=2, real model


@pytest.fixture(scope="module")
def reference(hf_model_and_tokenizer):
    """The single-engine greedy answers, by prompt: (text, finish_reason)."""
    model, tokenizer = hf_model_and_tokenizer
    llm = LLM(model, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                           use_tqdm=False)
    return {o.prompt: (o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs}


@pytest.mark.model
async def test_dp2_real_model_matches_one_engine_and_waves_end_and_restart(reference):
    rpc_port = free_port_pair()
    with ServerProcess("--data-parallel-size", "2", "--max-num-seqs", "8",
                       "--data-parallel-rpc-port", str(rpc_port), *SMALL) as server:
        engines = server.engine_processes()
        assert len(engines) == 2
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http, \
                asyncio.timeout(240):
            # A burst, spread by load over both engines, batched differently than offline.
            choices = await asyncio.gather(*(_complete(http, p) for p in PROMPTS))
            got = {p: (c["text"], c["finish_reason"]) for p, c in zip(PROMPTS, choices)}
            assert got == reference
            m = await _metrics(http)
            assert _successes(m, "0") > 0 and _successes(m, "1") > 0, "one engine served all"
            assert _successes(m, "0") + _successes(m, "1") == len(PROMPTS)
            assert m["vllm:generation_tokens_total", "0"] > 0
            assert m["vllm:generation_tokens_total", "1"] > 0

            await _poll(lambda: _engines_idle(http), IDLE_TIMEOUT_S, "no request left")
            # The wave ends: the ranks stop stepping (no endless dummy batches).
            await _poll(lambda: _cpu_quiet(engines), IDLE_TIMEOUT_S, "the engines pause")

            # A second burst after the wave ended: the ranks wake (a hang would time out).
            second = PROMPTS[::7]
            choices = await asyncio.gather(*(_complete(http, p) for p in second))
            assert [(c["text"], c["finish_reason"]) for c in choices] == \
                [reference[p] for p in second]
            before = await _metrics(http)
            assert sum(_successes(before, e) for e in "01") == len(PROMPTS) + len(second)

            # An explicit rank is obeyed.
            choice = await _complete(http, PROMPTS[0], **{RANK: "1"})
            assert (choice["text"], choice["finish_reason"]) == reference[PROMPTS[0]]
            after = await _metrics(http)
            assert _successes(after, "1") == _successes(before, "1") + 1
            assert _successes(after, "0") == _successes(before, "0")

            bad = await http.post("/v1/completions", headers={RANK: "5"},
                                  json={"prompt": "hi", "max_tokens": 2})
            assert bad.status_code == 400
            error = bad.json()["error"]
            assert (error["code"], error["param"]) == (400, RANK)
            assert "[0, 2)" in error["message"]
            assert (await http.get("/health")).status_code == 200


# ------------------------------------------------------------------ headless rank


class _Frontend(ServerProcess):
    """A ServerProcess whose `with` returns as soon as the process runs: its /health turns 200
    only once every engine is ready, and rank 1 is started only afterwards."""

    def _wait_ready(self) -> None:
        pass

    def wait_healthy(self) -> None:
        ServerProcess._wait_ready(self)


class _Headless:
    """`serve --headless` in its own session; killed with its whole group at exit."""

    def __init__(self, *args: str):
        self.args = [*MINICORE, "serve", "--headless", *args]
        self.log_path = Path(tempfile.mkstemp(prefix="minicore-headless-", suffix=".log")[1])
        self.proc = None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def __enter__(self):
        self.proc = start_minicore(self.args, self.log_path)
        return self

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        self.log_path.unlink(missing_ok=True)


async def test_headless_rank_serves_and_stops_when_the_frontend_goes():
    rpc_port = free_port_pair()
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-rpc-port", str(rpc_port), *SIMULATED]
    with _Frontend(*dp) as server, _Headless("--data-parallel-start-rank", "1", *dp) as headless:
        await asyncio.wait_for(asyncio.to_thread(server.wait_healthy), STARTUP_TIMEOUT_S + 10)
        assert headless.proc.poll() is None, headless.output()
        assert len(server.engine_processes()) == 1  # rank 0; rank 1 runs in the headless one
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, \
                asyncio.timeout(60):
            to_rank1 = [_complete(http, f"remote {i}", **{RANK: "1"}) for i in range(3)]
            anywhere = [_complete(http, f"any {i}") for i in range(4)]
            choices = await asyncio.gather(*to_rank1, *anywhere)
            assert all(c["finish_reason"] == "length" and c["text"] for c in choices)
            m = await _metrics(http)
            assert _successes(m, "1") >= 3
            assert _successes(m, "0") + _successes(m, "1") == 7

        headless_engines = psutil.Process(headless.proc.pid).children(recursive=True)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(EXIT_TIMEOUT_S)
        # Its engine sees the frontend's sockets close, and the command then ends by itself.
        try:
            headless.proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the headless command outlived its frontend:\n{headless.output()}")
        # Not its exit status: minicore/dp/launch.py reads the rank's exitcode before reaping it,
        # so a clean stop exits 0 or 1 by chance.
        _, alive = psutil.wait_procs(headless_engines, timeout=2)
        assert not alive, f"left behind: {alive}"


# ------------------------------------------------------------------ a rank dies


async def _long_stream(http: httpx.AsyncClient, rank: int, started: asyncio.Event):
    """A long streamed completion on one rank: its events, or the exception that broke it."""
    events = []
    try:
        async with http.stream("POST", "/v1/completions", headers={RANK: str(rank)}, json={
                "prompt": f"Tell me everything, rank {rank}.", "max_tokens": 1000,
                "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    started.set()
    except httpx.HTTPError as e:  # a broken response is an acceptable end too; a hang is not
        return events, e
    return events, None


async def _kill_mid_streams(http: httpx.AsyncClient, rank: psutil.Process) -> list:
    """Kill rank while four long streams run (two pinned to each rank, each past its first
    token); wait for /health to say 503 and return every stream's (events, error)."""
    started = [asyncio.Event() for _ in range(4)]
    streams = [asyncio.create_task(_long_stream(http, i % 2, started[i])) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    rank.kill()
    await _poll(lambda: _status_is(http, "/health", 503), FAIL_FAST_S, "/health 503")
    return await asyncio.wait_for(asyncio.gather(*streams), FAIL_FAST_S)


async def test_killed_rank_fails_streams_and_stops_its_peer():
    rpc_port = free_port_pair()
    with ServerProcess(*SIMULATED, "--simulated-cost", '{"step_s": 0.01}',
                       "--data-parallel-size", "2",
                       "--data-parallel-rpc-port", str(rpc_port)) as server:
        rank0, rank1 = _engines_by_rank(server, rpc_port)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, \
                asyncio.timeout(90):
            # Every stream ends, on both ranks: the survivor cannot go on without its peer.
            results = await _kill_mid_streams(http, rank1)
            for events, broken in results:
                if broken is None:
                    assert "error" in events[-1], events[-1]
                    assert events[-1]["error"]["code"] == 503
                    # The frontend names the rank that died: the one we killed.
                    assert "engine core 1" in events[-1]["error"]["message"]
                assert all(e["choices"][0]["finish_reason"] is None
                           for e in events if "choices" in e), "a stream finished normally"

            refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503
            # The frontend stops rank 0 rather than leave it waiting on a dead peer.
            _, alive = await asyncio.to_thread(psutil.wait_procs, [rank0], EXIT_TIMEOUT_S)
            assert not alive, "rank 0's engine outlived its dead peer"
            assert server.proc.poll() is None  # the server stays up to say so

        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(EXIT_TIMEOUT_S)


async def _status_is(http: httpx.AsyncClient, path: str, status: int) -> bool:
    return (await http.get(path)).status_code == status


async def test_expert_parallel_rank_killed_mid_wave_is_reported_by_its_peer(moe_model_dir):
    rpc_port = free_port_pair()
    # Room for _long_stream's 1000 tokens. Both sides float32, as the frontend's ServerProcess
    # pins it: the ranks must agree (auto is bfloat16 on a CPU with native bfloat16).
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-rpc-port", str(rpc_port), "--model", moe_model_dir("qwen3_moe"),
          "--enable-expert-parallel", "--max-model-len", "1100", "--kv-cache-memory",
          str(64 << 20), "--dtype", "float32"]
    with _Frontend(*dp) as server, _Headless("--data-parallel-start-rank", "1", *dp) as headless:
        await asyncio.wait_for(asyncio.to_thread(server.wait_healthy), STARTUP_TIMEOUT_S + 10)
        (rank0,) = server.engine_processes()
        (rank1,) = [p for p in psutil.Process(headless.proc.pid).children(recursive=True)
                    if is_engine(p)]
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, \
                asyncio.timeout(90):
            results = await _kill_mid_streams(http, rank1)
            assert any(broken is None for _, broken in results), results
            for events, broken in results:
                if broken is None:
                    assert events[-1]["error"]["code"] == 503, events[-1]
                    # Rank 0 ended itself on the failed collective (a fatal error: exit code 1).
                    assert "engine core 0's process exited with code 1" in \
                        events[-1]["error"]["message"]
                assert all(e["choices"][0]["finish_reason"] is None
                           for e in events if "choices" in e), "a stream finished normally"
            refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503
            _, alive = await asyncio.to_thread(psutil.wait_procs, [rank0], EXIT_TIMEOUT_S)
            assert not alive, "rank 0's engine outlived its dead peer"
            # The headless command stops once its rank is gone.
            await asyncio.to_thread(headless.proc.wait, EXIT_TIMEOUT_S)
            assert server.proc.poll() is None

        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(EXIT_TIMEOUT_S)
