"""Elastic expert parallelism (--enable-elastic-ep, POST /scale_elastic_ep) on a two-node Ray
cluster made here (a head of one CPU, a second node of two), with a tiny Qwen3-MoE of 8 experts.

- 2 -> 3 -> 2 ranks with requests in flight at each scale, the balance gate on (its count sync
  runs on the new group): every request completes, once, with one engine's greedy tokens
  (float32); the new rank serves (a request pinned to it); the rank a
  scale down removes is gone, and requests pinned to it are refused afterwards; a second scale
  while one runs is refused;
- refused, with the engines serving on: below one rank, more ranks than experts, more than the
  cluster holds; and with elastic EP off;
- the route's body and errors, as vLLM's (on a scripted client).
"""

import asyncio
from types import SimpleNamespace

import httpx
import pytest
import ray
from dp_helpers import (
    assert_all_engines_idle,
    dp_client,
    free_port_pair,
    one_engine_tokens,
    token_prompts,
    wait_idle,
)
from ray.cluster_utils import Cluster
from server_helpers import free_port
from test_api_unit import MODEL, ScriptedClient, tokenizer_and_vocab

from minicore.config import create_engine_config
from minicore.engine.async_llm import AsyncLLM
from minicore.engine.input_processor import InvalidRequestError
from minicore.entrypoints.api_server import build_app
from minicore.entrypoints.metrics import ServerMetrics
from minicore.entrypoints.serving import OpenAIServing
from minicore.sampling_params import SamplingParams

__all__ = ["tokenizer_and_vocab"]  # a fixture, used by name

ENGINE_ARGS = dict(max_model_len=256, kv_cache_memory=16 << 20, dtype="float32")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def elastic_cluster():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_enable_worker_prestart", "0")  # as test_ray.py: no idle workers
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"head": 1}, "dashboard_port": free_port()})
        cluster.add_node(num_cpus=2, resources={"node2": 1})
        cluster.wait_for_nodes()
        yield cluster
        cluster.shutdown()


def engine_actor_names() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("EngineCore_DP"))


@pytest.mark.model
async def test_elastic_ep_scales_2_3_2_with_requests_in_flight(elastic_cluster, moe_model_dir,
                                                              monkeypatch):
    model_dir = moe_model_dir("qwen3_moe")
    prompts = token_prompts(model_dir, [5 + i for i in range(6)])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected = one_engine_tokens(model_dir, prompts, params, **ENGINE_ARGS)

    monkeypatch.setenv("RAY_ADDRESS", elastic_cluster.address)
    config = create_engine_config(
        model=model_dir, data_parallel_size=2, data_parallel_backend="ray",
        data_parallel_size_local=1, data_parallel_rpc_port=free_port_pair(),
        enable_expert_parallel=True, enable_elastic_ep=True, balance_scheduling=True,
        **ENGINE_ARGS)
    names = iter(range(1000))

    async def run(i, rank=None):
        outputs = [o async for o in client.generate(prompts[i], params, f"req-{next(names)}",
                                                    data_parallel_rank=rank)]
        assert sum(o.finished for o in outputs) == 1
        return outputs[-1].outputs[0].token_ids

    async def scale_with_requests_in_flight(new_size, pinned_rank):
        runs = [asyncio.create_task(run(i)) for i in range(len(prompts))]
        runs.append(asyncio.create_task(run(0, pinned_rank)))
        await asyncio.sleep(0.5)  # under way on every rank
        scale = asyncio.create_task(client.scale_elastic_ep(new_size))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="being scaled already"):
            await client.scale_elastic_ep(1)
        await asyncio.wait_for(scale, 120)
        assert await asyncio.wait_for(asyncio.gather(*runs), 120) == [*expected, expected[0]]

    async with dp_client(config) as client:
        assert await asyncio.gather(*(run(i) for i in range(6))) == expected
        await scale_with_requests_in_flight(3, pinned_rank=1)
        assert client.num_engines == 3
        assert engine_actor_names() == ["EngineCore_DP0", "EngineCore_DP1", "EngineCore_DP2"]
        # The new rank serves; the three step together (its forwards meet theirs).
        assert await asyncio.gather(run(3, 2), run(4), run(5)) == expected[3:]

        await scale_with_requests_in_flight(2, pinned_rank=2)  # rank 2's request is drained
        assert client.num_engines == 2
        assert engine_actor_names() == ["EngineCore_DP0", "EngineCore_DP1"]
        with pytest.raises(InvalidRequestError, match="ranks \\[0, 2\\)"):
            await run(0, 2)
        assert await asyncio.gather(*(run(i) for i in range(6))) == expected

        for size, why in ((0, "must be a positive integer"), (9, "at least 9 experts"),
                          (4, "the Ray cluster cannot hold 4 DP ranks")):
            with pytest.raises(ValueError, match=why):
                await client.scale_elastic_ep(size)
        assert client.num_engines == 2
        assert await run(1) == expected[1]
        await wait_idle(client)
        await assert_all_engines_idle(client)
    assert not ray.is_initialized()  # the client left the cluster as it found it


async def test_elastic_ep_off_is_refused():
    # An AsyncLLM whose engine client cannot scale (any backend but Ray with the flag).
    llm = SimpleNamespace(engine_core=object(), is_scaling_elastic_ep=False)
    with pytest.raises(ValueError, match="elastic EP is off"):
        await AsyncLLM.scale_elastic_ep(llm, 3)
    with pytest.raises(ValueError, match="--enable-elastic-ep needs --data-parallel-backend ray"):
        create_engine_config(data_parallel_size=2, enable_expert_parallel=True,
                             enable_elastic_ep=True)


@pytest.mark.parametrize("body, status, message", [
    (b"{", 400, "Invalid JSON format"),
    (b"{}", 400, "new_data_parallel_size is required"),
    (b'{"new_data_parallel_size": 0}', 400, "must be a positive integer"),
    (b'{"new_data_parallel_size": true}', 400, "must be a positive integer"),
    (b'{"new_data_parallel_size": 3, "drain_timeout": 0}', 400, "drain_timeout must be"),
    (b'{"new_data_parallel_size": 3}', 200, "Scaled to 3 data parallel engines"),
    (b'{"new_data_parallel_size": 5}', 400, "no room"),
    (b'{"new_data_parallel_size": 4, "drain_timeout": 7}', 408,
     "request drain timeout after 7 seconds"),
])
async def test_scale_route_checks_its_body_and_maps_errors_as_vllm(tokenizer_and_vocab, body,
                                                                   status, message):
    class ScalingClient(ScriptedClient):
        is_scaling_elastic_ep = False

        async def scale_elastic_ep(self, size, drain_timeout):
            if size == 5:
                raise ValueError("no room for 5 DP ranks")
            if size == 4:
                raise TimeoutError("the requests of DP ranks 2..3 did not finish")
            self.scaled = (size, drain_timeout)

    client = ScalingClient(*tokenizer_and_vocab)
    metrics = ServerMetrics(MODEL, 2, lambda: client.latest_stats)
    app = build_app(client, OpenAIServing(client, [MODEL]), metrics, log_stats=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        response = await http.post("/scale_elastic_ep", content=body)
        assert response.status_code == status, response.text
        assert message in response.text
        if status == 200:
            assert client.scaled == (3, 120)
            assert metrics.engine_labels == ["0", "1", "2"]  # series for the new engine
        scaling = await http.post("/is_scaling_elastic_ep")
        assert scaling.json() == {"is_scaling_elastic_ep": False}

