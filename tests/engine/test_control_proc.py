"""The control plane in an engine process (one engine, simulated runner, with and without async
scheduling): a pause answers once the busy loop is idle, with steps in flight drained first;
requests kept through a pause (their KV dropped or not) and requests sent while paused end as an
unpaused run of the same prompt does; sleep holds requests until wake_up; a result that cannot
be sent back is an error for the caller, and the engine serves on."""

import asyncio
import itertools

import pytest

from minicore.config import create_engine_config
from minicore.engine.async_llm import AsyncLLM
from minicore.model.config import SimulatedCost
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

TIMEOUT_S = 60
PARAMS = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("clear_cache", [False, True])
async def test_kept_and_held_requests_end_as_unpaused_ones(async_scheduling, clear_cache,
                                                          monkeypatch):
    monkeypatch.setenv("MINICORE_ALLOW_INSECURE_SERIALIZATION", "1")
    config = create_engine_config(runner="simulated", simulated_cost=SimulatedCost(step_s=0.005),
                                  async_scheduling=async_scheduling)
    llm = await asyncio.wait_for(AsyncLLM.from_engine_config(config), TIMEOUT_S)
    ids = itertools.count()

    async def run(prompt):
        outputs = [o async for o in llm.generate(prompt, PARAMS, f"r{next(ids)}")]
        return outputs[-1].outputs[0].token_ids

    try:
        async with asyncio.timeout(TIMEOUT_S):
            prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
            reference = await asyncio.gather(*(run(p) for p in prompts))
            kept = [asyncio.ensure_future(run(p)) for p in prompts[:2]]
            await asyncio.sleep(0.1)
            await llm.pause_generation(mode="keep", clear_cache=clear_cache)
            stats = await llm.call_utility("get_stats")
            assert len(stats["request_ids"]) == 2 and not any(t.done() for t in kept)
            assert (stats["kv_cache_usage"] == 0) == clear_cache
            held = asyncio.ensure_future(run(prompts[2]))
            gone = asyncio.ensure_future(anext(aiter(llm.generate([3], PARAMS, "gone"))))
            await asyncio.sleep(0.2)
            assert not held.done() and not gone.done()
            await llm.abort("gone")  # held, never sent: it ends at once, as "abort"
            assert (await gone).outputs[0].finish_reason == "abort"
            assert "gone" not in (await llm.call_utility("get_stats"))["request_ids"]
            await llm.resume_generation()
            assert await asyncio.gather(*kept, held) == reference

            await llm.sleep(1, mode="keep")
            after_wake = asyncio.ensure_future(run(prompts[0]))
            await asyncio.sleep(0.1)
            assert not after_wake.done() and await llm.is_sleeping()
            await llm.wake_up()
            assert await after_wake == reference[0]

            with pytest.raises(RuntimeError, match="cannot be sent back"):
                await llm.collective_rpc(lambda runner: object())
            assert await llm.call_utility("ping") == "pong"
    finally:
        await llm.shutdown()
