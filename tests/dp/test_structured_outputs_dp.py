"""Structured outputs under data parallelism with expert parallelism: each engine process compiles
the grammars of its own requests, masks its own steps, and the two ranks' forwards (dummy ones
included) still meet in every MoE layer: greedy outputs equal one in-process engine's, every one
obeying its constraint, and both ranks end idle."""

import asyncio
import json
import random
import re

import jsonschema
import pytest
from dp_helpers import assert_all_engines_idle, dp_client, free_port_pair, wait_idle

from minicore.config import create_engine_config
from minicore.llm import LLM
from minicore.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

# float32: the DP=2 + EP tokens equal one engine's bit for bit only there (bfloat16 rows change
# with the batch around them).
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
# (rank, constraint, check of the text); the random model would ramble in JSON whitespace.
PLAN = [
    (0, {"json": SCHEMA, "disable_any_whitespace": True},
     lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
    (0, {"regex": r"[a-z]{2,6}-\d{3}"},
     lambda text: re.fullmatch(r"[a-z]{2,6}-\d{3}", text) or pytest.fail(text)),
    (1, {"choice": ["alpha", "beta", "gamma"]},
     lambda text: text in ("alpha", "beta", "gamma") or pytest.fail(text)),
]
TIMEOUT_S = 90


def params(constraint: dict) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=0,
                          structured_outputs=StructuredOutputsParams(**constraint))


async def test_dp2_expert_parallel_structured_outputs_equal_one_engine(moe_model_dir):
    model_dir = moe_model_dir("qwen3_moe")
    rng = random.Random(27)
    prompts = [[rng.randrange(3, 1000) for _ in range(12)] for _ in PLAN]
    reference = [o.outputs[0].text for o in LLM(model_dir, **ENGINE_ARGS).generate(
        prompts, [params(c) for _, c, _ in PLAN], use_tqdm=False)]

    config = create_engine_config(model=model_dir, data_parallel_size=2,
                                  data_parallel_rpc_port=free_port_pair(),
                                  enable_expert_parallel=True, **ENGINE_ARGS)
    async with dp_client(config) as client:
        async def run(i: int) -> str:
            rank, constraint, _ = PLAN[i]
            outputs = [o async for o in client.generate(prompts[i], params(constraint),
                                                        f"req-{i}", data_parallel_rank=rank)]
            return outputs[-1].outputs[0].text

        got = await asyncio.wait_for(asyncio.gather(*map(run, range(len(PLAN)))), TIMEOUT_S)
        await wait_idle(client)
        await assert_all_engines_idle(client)
    assert got == reference
    for text, (_, _, check) in zip(got, PLAN):
        check(text)
