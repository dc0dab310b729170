"""The engine process on the real default model: greedy tokens streamed through
AsyncLLM equal offline LLM.generate's for the same prompts."""

import asyncio

import pytest

from minicore.config import create_engine_config
from minicore.engine.async_llm import AsyncLLM
from minicore.llm import LLM
from minicore.sampling_params import SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.asyncio(loop_scope="session")]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
ENGINE_ARGS = {"max_model_len": 256, "max_num_seqs": 8, "kv_cache_memory": 64 << 20}


async def test_greedy_tokens_equal_offline_llm(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    params = SamplingParams(max_tokens=24, temperature=0)
    expected = LLM(model, tokenizer=tokenizer, **ENGINE_ARGS).generate(PROMPTS, params,
                                                                       use_tqdm=False)
    config = create_engine_config(dtype="float32", device="cpu", **ENGINE_ARGS)
    client = await asyncio.wait_for(AsyncLLM.from_engine_config(config), 180)
    try:
        async def run(i: int, prompt: str):
            return [o async for o in client.generate(prompt, params, f"greedy-{i}")]

        async with asyncio.timeout(120):
            streams = await asyncio.gather(*(run(i, p) for i, p in enumerate(PROMPTS)))
    finally:
        await client.shutdown()
    assert client.engine_core.procs[0].exitcode == 0
    for outputs, offline in zip(streams, expected, strict=True):
        final = outputs[-1]
        assert final.finished and final.prompt == offline.prompt
        assert final.outputs[0].token_ids == offline.outputs[0].token_ids
        assert final.outputs[0].text == offline.outputs[0].text
        assert final.outputs[0].finish_reason == offline.outputs[0].finish_reason
        assert len(outputs) > 1  # streamed, not delivered in one piece
