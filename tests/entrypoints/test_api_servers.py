"""`serve --api-server-count 2`: two API server processes over the same engines.

- DP=2 on the real model: 100 concurrent streamed greedy completions, spread by the kernel over
  both servers (their access logs say which), each answered once, with the single engine's text;
  /metrics counts all of them whichever server answers; afterwards the engines are idle and their
  KV cache empty. SIGTERM to the launcher stops everything, exit 0.
- One API server, or the engine, killed (SIGKILL): the service stops, as vLLM's (the launcher
  stops the other processes and exits 1 naming the dead one).
"""

import asyncio
import json
import re
import signal
import time
from collections import Counter, defaultdict

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerProcess

from minicore.llm import LLM
from minicore.ports import free_port_pair
from minicore.sampling_params import SamplingParams

MAX_MODEL_LEN = 256
SMALL = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(32 << 20)]
MAX_TOKENS = 6
PROMPTS = [f"{start}, the next numbers are" for start in ("1 2 3", "10 20", "a b c", "5 4 3",
                                                          "2 4 6", "x y", "7 8", "100 200",
                                                          "3 6 9", "z y x")]
NUM_REQUESTS = 100
EXIT_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def reference(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    llm = LLM(model, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN, kv_cache_memory=32 << 20)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                           use_tqdm=False)
    return {o.prompt: o.outputs[0].text for o in outputs}


class ApiServers(ServerProcess):
    """A server with N API servers, their access logs on (they tell which server answered)."""

    def __init__(self, count: int, *args: str):
        super().__init__("--api-server-count", str(count), *SMALL, *args)
        self.args.remove("--disable-uvicorn-access-log")

    def api_servers(self) -> list[psutil.Process]:
        return sorted((p for p in self.children() if p.name().startswith("APIServer_")),
                      key=lambda p: p.name())

    def answered_by(self) -> Counter:
        """Completions each API server answered, from its access log lines."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return Counter(m.group(1) for line in lines
                       if (m := re.match(r"\((APIServer_\d+) pid=\d+\).*POST /v1/completions",
                                         line)))


async def stream(http: httpx.AsyncClient, prompt: str) -> tuple[str, str, list[str]]:
    """(text, finish_reason, the response ids seen) of one streamed greedy completion."""
    text, finish, ids = "", None, set()
    async with http.stream("POST", "/v1/completions", json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                ids.add(event["id"])
                text += event["choices"][0]["text"]
                finish = event["choices"][0]["finish_reason"] or finish
    return text, finish, sorted(ids)


async def metrics(http: httpx.AsyncClient) -> dict[tuple[str, str | None], float]:
    values = defaultdict(float)
    for family in text_string_to_metric_families((await http.get("/metrics")).text):
        for sample in family.samples:
            values[sample.name, sample.labels.get("engine")] += sample.value
    return values


@pytest.mark.model
async def test_two_api_servers_share_the_port_and_the_engines(reference):
    with ApiServers(2, "--data-parallel-size", "2", "--max-num-seqs", "16",
                    "--data-parallel-rpc-port", str(free_port_pair())) as server:
        assert [p.name() for p in server.api_servers()] == ["APIServer_0", "APIServer_1"]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(NUM_REQUESTS)]
        # A connection per request: the kernel picks the server of each.
        limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http, \
                asyncio.timeout(240):
            answers = await asyncio.gather(*(stream(http, p) for p in prompts))
            for prompt, (text, finish, ids) in zip(prompts, answers):
                assert (text, finish) == (reference[prompt], "length")
                assert len(ids) == 1
            assert len({ids[0] for _, _, ids in answers}) == NUM_REQUESTS  # each answered once
            by_server = server.answered_by()
            assert sum(by_server.values()) == NUM_REQUESTS
            assert by_server["APIServer_0"] > 0 and by_server["APIServer_1"] > 0, by_server

            deadline = time.monotonic() + 30
            while True:  # the engines' last stats reach every server a moment after the streams
                m = await metrics(http)
                idle = all(m["vllm:num_requests_running", e] == m["vllm:num_requests_waiting", e]
                           == m["vllm:kv_cache_usage_perc", e] == 0 for e in "01")
                if idle or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            assert idle, m
            # Whichever server answers, /metrics has every server's requests.
            for _ in range(4):
                m = await metrics(http)
                assert sum(m["vllm:request_success_total", e] for e in "01") == NUM_REQUESTS
                assert m["vllm:request_success_total", "0"] > 0
                assert m["vllm:request_success_total", "1"] > 0
                assert sum(m["vllm:generation_tokens_total", e] for e in "01") == \
                    NUM_REQUESTS * MAX_TOKENS
        processes = [psutil.Process(server.proc.pid), *server.children()]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(EXIT_TIMEOUT_S) == 0
        gone, alive = psutil.wait_procs(processes, timeout=EXIT_TIMEOUT_S)
        assert not alive, alive


@pytest.mark.model
@pytest.mark.parametrize("victim", ["APIServer_1", "EngineCore_DP0"])
async def test_a_process_killed_stops_the_service(victim):
    with ApiServers(2) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            assert (await stream(http, PROMPTS[0]))[1] == "length"
        processes = [psutil.Process(server.proc.pid), *server.children()]
        (process,) = [p for p in processes if p.name() == victim]
        process.kill()
        assert server.proc.wait(EXIT_TIMEOUT_S) == 1
        assert re.search(victim + r" \(pid \d+\) exited with code -9: the service stops",
                         server.log_path.read_text())
        gone, alive = psutil.wait_procs(processes, timeout=EXIT_TIMEOUT_S)
        assert not alive, alive
