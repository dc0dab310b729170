"""Async scheduling under data parallelism with expert parallelism: DPEngineCoreProc steps with
the batch queue (the next step scheduled while the forward before runs), and its forwards, dummy
ones included, still meet in every MoE layer in the same order on both ranks.

First through the DP client, with the balance gate: rank 0 fills up, rank 1 holds a gated request
and runs dummy forwards, then runs it beside rank 0's (the plan of test_expert_parallel_serving.py).
Then served: `serve --data-parallel-size 2 --enable-expert-parallel --async-scheduling` on the tiny
DeepSeek-V3 (multi-head latent attention; shared experts, grouped router, a dense first layer),
requests spread over both ranks, structured ones among them, greedy tokens equal to one in-process
engine's without async scheduling.
"""

import asyncio
import random
import re

import httpx
import pytest
from dp_helpers import assert_all_engines_idle, dp_client, free_port_pair, wait_idle
from server_helpers import ServerProcess
from test_expert_parallel_serving import MAX_NUM_SEQS, greedy, served_tokens

from minicore.config import create_engine_config
from minicore.llm import LLM
from minicore.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

# float32: the DP=2 + EP tokens equal one engine's bit for bit only there (bfloat16 rows change
# with the batch around them).
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
# test_expert_parallel_serving.py's plan, with rank 0's requests longer: async steps are quicker,
# and the gated request must reach rank 1 while rank 0 is still full.
PLAN = [(0, 23, 120), (0, 5, 144), (0, 11, 96), (1, 9, 12)]
TIMEOUT_S = 90


def reference_outputs(model_dir: str, prompts: list[list[int]], max_tokens: list[int]):
    llm = LLM(model_dir, async_scheduling=False, **ENGINE_ARGS)
    return [o.outputs[0] for o in llm.generate(
        prompts, [greedy(n) for n in max_tokens], use_tqdm=False)]


async def test_dp2_expert_parallel_with_async_scheduling_gives_the_tokens_of_one_engine(
        moe_model_dir):
    model_dir = moe_model_dir("qwen3_moe")
    rng = random.Random(26)
    prompts = [[rng.randrange(3, 1000) for _ in range(length)] for _, length, _ in PLAN]
    reference = [o.token_ids for o in reference_outputs(model_dir, prompts,
                                                        [n for *_, n in PLAN])]

    config = create_engine_config(model=model_dir, data_parallel_size=2,
                                  data_parallel_rpc_port=free_port_pair(),
                                  enable_expert_parallel=True, balance_scheduling=True,
                                  max_num_seqs=MAX_NUM_SEQS, async_scheduling=True,
                                  **ENGINE_ARGS)
    async with dp_client(config) as client:
        got, rank1_waiting = await asyncio.wait_for(served_tokens(client, prompts, PLAN),
                                                       TIMEOUT_S)
        await wait_idle(client)
        await assert_all_engines_idle(client)
    assert got == reference
    assert 1 in rank1_waiting, rank1_waiting  # rank 1 held its request through dummy forwards


# Served beside the plain requests: a structured one per rank, its grammar masking each step
# while the step before is in flight.
GRAMMARS = [{"regex": r"[0-9]{3}-[a-z]{4}"}, {"choice": ["alpha", "beta", "gamma"]}]


async def test_served_dp2_with_async_scheduling_gives_the_text_of_one_engine(moe_model_dir):
    model_dir = moe_model_dir("deepseek_v3")
    rng = random.Random(260)
    plan = [(rng.randrange(4, 40), rng.randrange(4, 40)) for _ in range(6)]
    prompts = [[rng.randrange(3, 1000) for _ in range(length)] for length, _ in plan]
    reference = [o.text for o in reference_outputs(model_dir, prompts, [n for _, n in plan])]
    structured_reference = [o.outputs[0].text for o in LLM(
        model_dir, async_scheduling=False, **ENGINE_ARGS).generate(
        prompts[:2], [SamplingParams(max_tokens=16, temperature=0,
                                     structured_outputs=StructuredOutputsParams(**g))
                      for g in GRAMMARS], use_tqdm=False)]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{4}", structured_reference[0])
    assert structured_reference[1] in ("alpha", "beta", "gamma")
    with ServerProcess(model_dir, "--data-parallel-size", "2",
                       "--data-parallel-rpc-port", str(free_port_pair()),
                       "--enable-expert-parallel", "--async-scheduling",
                       "--max-model-len", "256", "--kv-cache-memory", str(16 << 20)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as http:
            async def complete(prompt: list[int], **fields) -> str:
                response = await http.post("/v1/completions", json={
                    "model": model_dir, "prompt": prompt, "temperature": 0, **fields})
                response.raise_for_status()
                return response.json()["choices"][0]["text"]

            got = await asyncio.gather(
                *(complete(p, max_tokens=n, ignore_eos=True) for p, (_, n) in zip(prompts, plan)),
                *(complete(p, max_tokens=16, structured_outputs=g)
                  for p, g in zip(prompts, GRAMMARS)))
        log = server.log()
    assert got == reference + structured_reference
    assert log.count("async_scheduling=True") == 2, log  # both ranks run the batch queue
