"""External and hybrid load balancing: a frontend per rank (or per machine), each on its own port,
sending requests to its own ranks only, the ranks' waves kept in step by the wave coordinator that
rank 0's frontend runs.

- External, real model: two `serve --data-parallel-rank R` processes behind a round robin of the
  test's own: every answer is the single engine's; a request longer than the 32-step wave sync
  sent to rank 1 alone finishes (rank 0 was woken and steps in its wave: its engine works
  meanwhile, and goes quiet after); each frontend's /metrics is its own rank's; another rank's
  X-data-parallel-rank is refused.
- Hybrid, simulated runner, DP=4 over two "machines" of two ranks: each frontend spreads its
  requests over its own two ranks only, and long requests to either finish.
- The flags' rules, as vLLM's.
"""

import asyncio
import contextlib
import itertools
from collections import defaultdict

import httpx
import psutil
import pytest
from dp_helpers import free_port
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerProcess, is_engine, start_minicore

from minicore import __main__ as cli
from minicore.config import ParallelConfig
from minicore.llm import LLM
from minicore.sampling_params import SamplingParams

MAX_MODEL_LEN = 256
SMALL = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(32 << 20)]
SIMULATED = ["--runner", "simulated", "--simulated-cost", '{"step_s": 0.002}']
PROMPTS = [f"Tell me about {topic}:" for topic in ("rivers", "bread", "owls", "glass", "maps",
                                                   "tides", "salt", "kites")]
MAX_TOKENS = 8
LONG_TOKENS = 40  # past the 32-step sync, where a rank stepping alone would wait for its peer
RANK = "X-data-parallel-rank"


@contextlib.contextmanager
def instances(*argvs: list[str]):
    """A `serve` per argv, started together (none is healthy before all have joined the DP
    group), each killed with its process group at the end."""
    servers = [ServerProcess(*argv) for argv in argvs]
    with contextlib.ExitStack() as stack:
        for server in servers:
            server.proc = start_minicore(server.args, server.log_path, server.env)
            stack.callback(server.__exit__, None, None, None)
        for server in servers:
            server._wait_ready()
        yield servers


async def complete(http, url: str, prompt: str, max_tokens: int = MAX_TOKENS,
                       headers: dict | None = None) -> dict:
    response = await http.post(f"{url}/v1/completions", headers=headers or {}, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


async def metrics(http: httpx.AsyncClient, url: str) -> dict:
    values = defaultdict(float)
    for family in text_string_to_metric_families((await http.get(f"{url}/metrics")).text):
        for sample in family.samples:
            values[sample.name, sample.labels.get("engine")] += sample.value
    return values


def cpu_seconds(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


@pytest.fixture(scope="module")
def reference(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    llm = LLM(model, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN, kv_cache_memory=32 << 20)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {o.prompt: o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)}


@pytest.mark.model
async def test_external_lb_rank_pinned_frontends_keep_the_waves_in_step(reference):
    dp = ["--data-parallel-size", "2", "--data-parallel-rpc-port", str(free_port(span=3)),
          "--max-num-seqs", "8", *SMALL]
    with instances([*dp, "--data-parallel-rank", "0"],
                   [*dp, "--data-parallel-rank", "1"]) as (rank0, rank1):
        engine0 = [p for p in rank0.children() if is_engine(p)]
        assert len(engine0) == 1 and len([p for p in rank1.children() if is_engine(p)]) == 1
        async with httpx.AsyncClient(timeout=120) as http, asyncio.timeout(240):
            urls = itertools.cycle([rank0.url, rank1.url])  # the test's round robin
            answers = await asyncio.gather(*(complete(http, next(urls), p) for p in PROMPTS))
            assert [a["text"] for a in answers] == [reference[p] for p in PROMPTS]
            m0, m1 = await metrics(http, rank0.url), await metrics(http, rank1.url)
            assert m0["vllm:request_success_total", "0"] == len(PROMPTS) // 2
            assert m1["vllm:request_success_total", "1"] == len(PROMPTS) // 2
            assert ("vllm:request_success_total", "1") not in m0
            assert ("vllm:request_success_total", "0") not in m1

            # Rank 1 alone gets a long request: rank 0 steps with it (dummy batches) until the
            # wave ends, or rank 1 would wait for it at the 32nd step forever.
            await asyncio.sleep(1.0)
            before = cpu_seconds(engine0)
            long = await complete(http, rank1.url, PROMPTS[0], LONG_TOKENS)
            assert long["finish_reason"] == "length"
            assert cpu_seconds(engine0) - before > 0.2, "rank 0 did not step in rank 1's wave"
            for _ in range(30):  # the wave ends at a sync step, then rank 0 waits quietly
                quiet = cpu_seconds(engine0)
                await asyncio.sleep(1.0)
                if cpu_seconds(engine0) - quiet < 0.1:
                    break
            else:
                pytest.fail("rank 0 still steps: the wave did not end")

            refused = await http.post(f"{rank1.url}/v1/completions", headers={RANK: "0"},
                                      json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 400
            assert "[1, 2)" in refused.json()["error"]["message"]
            pinned = await complete(http, rank1.url, PROMPTS[1], headers={RANK: "1"})
            assert pinned["text"] == reference[PROMPTS[1]]


async def test_hybrid_lb_each_machine_balances_over_its_own_ranks():
    dp = ["--data-parallel-size", "4", "--data-parallel-size-local", "2",
          "--data-parallel-rpc-port", str(free_port(span=3)), *SIMULATED]
    with instances([*dp, "--data-parallel-hybrid-lb"],
                   [*dp, "--data-parallel-start-rank", "2"]) as (first, second):
        async with httpx.AsyncClient(timeout=120) as http, asyncio.timeout(120):
            for server, ranks in ((first, "01"), (second, "23")):
                answers = await asyncio.gather(*(
                    complete(http, server.url, f"p{i}", LONG_TOKENS) for i in range(8)))
                assert all(a["finish_reason"] == "length" for a in answers)
                m = await metrics(http, server.url)
                labelled = {e for name, e in m if name == "vllm:request_success_total"}
                assert labelled == set(ranks)  # this frontend's ranks only
                served = {e: m["vllm:request_success_total", e] for e in ranks}
                assert all(n > 0 for n in served.values()) and sum(served.values()) == 8, served


@pytest.mark.parametrize("kwargs, resolved", [
    ({"data_parallel_external_lb": True, "data_parallel_start_rank": 1}, (range(1, 2), True,
                                                                          False)),
    ({"data_parallel_hybrid_lb": True, "data_parallel_size_local": 2}, (range(0, 2), False,
                                                                        True)),
    # One rank per machine is external; every rank on one machine is internal (vLLM's rules).
    ({"data_parallel_hybrid_lb": True, "data_parallel_size_local": 1,
      "data_parallel_start_rank": 3}, (range(3, 4), True, False)),
    ({"data_parallel_hybrid_lb": True, "data_parallel_size_local": 4}, (range(0, 4), False,
                                                                        False)),
    ({}, (range(0, 4), False, False)),
])
def test_load_balancing_modes_resolve_as_vllms(kwargs, resolved):
    pc = ParallelConfig(data_parallel_size=4, **kwargs)
    assert (pc.engine_ranks, pc.data_parallel_external_lb, pc.data_parallel_hybrid_lb) == resolved


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-external-lb", "-dp", "2"], "`--data-parallel-external-lb` requires a "
                                                  "data-parallel rank"),
    (["-dp", "2", "--data-parallel-rank", "1", "--data-parallel-hybrid-lb"],
     "cannot be enabled together"),
    (["-dp", "4", "--data-parallel-rank", "1", "-dpl", "2"], "requires `--data-parallel-size-"
                                                             "local 1`"),
    (["-dp", "4", "--data-parallel-hybrid-lb"], "`--data-parallel-hybrid-lb` requires "
                                                "`--data-parallel-size-local`"),
    (["--data-parallel-rank", "0"], "need --data-parallel-size >= 2"),
    (["-dp", "2", "--data-parallel-rank", "1", "--headless"], "--headless ranks take"),
    (["-dp", "2", "--data-parallel-rank", "0", "--api-server-count", "2"],
     "--api-server-count > 1 is supported with the mp backend's internal load balancing only"),
    (["--headless", "-dp", "2", "-dpr", "1", "--api-server-count", "2"],
     "cannot be used with --headless"),
])
def test_load_balancing_flags_are_refused_as_vllms(argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--runner", "simulated", *argv])
    assert message in str(e.value.code)
