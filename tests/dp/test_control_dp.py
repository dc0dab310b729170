"""The control plane under data parallelism (two engine processes, simulated runner): a pause in
each mode holds new requests at the frontend, ends the wave on both ranks together (no rank left
in a collective the other will not join), and resume wakes both for the requests kept; sleep and
wake_up, collective_rpc and the weight-update calls reach every rank."""

import asyncio
import itertools

import pytest
from dp_helpers import assert_all_engines_idle, dp_client, simulated_dp_config, wait_idle

from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

TIMEOUT_S = 60
MAX_TOKENS = 60


def rank_blocks(runner) -> int:
    return runner.num_blocks


async def test_pause_modes_sleep_and_collective_rpc_on_two_ranks(monkeypatch):
    monkeypatch.setenv("MINICORE_ALLOW_INSECURE_SERIALIZATION", "1")
    ids = itertools.count()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    async with dp_client(simulated_dp_config(2, step_s=0.005)) as llm:
        async def run(rank: int):
            outputs = [o async for o in llm.generate([5, 6, 7], params, f"r{next(ids)}",
                                                     data_parallel_rank=rank)]
            return len(outputs[-1].outputs[0].token_ids), outputs[-1].outputs[0].finish_reason

        async with asyncio.timeout(TIMEOUT_S):
            # keep: both ranks' requests freeze, the wave ends, a new request waits.
            kept = [asyncio.ensure_future(run(rank)) for rank in (0, 1, 0)]
            await asyncio.sleep(0.2)
            await llm.pause_generation(mode="keep")
            assert await llm.is_paused()
            await wait_idle(llm)
            held = asyncio.ensure_future(run(1))
            await asyncio.sleep(0.3)
            assert not any(t.done() for t in [*kept, held])
            stats = [await llm.call_utility("get_stats", engine_index=r) for r in (0, 1)]
            assert [len(s["request_ids"]) for s in stats] == [2, 1]
            await llm.resume_generation()
            assert await asyncio.gather(*kept, held) == [(MAX_TOKENS, "length")] * 4
            await wait_idle(llm)

            # wait: the requests in flight finish before the pause completes.
            waited = [asyncio.ensure_future(run(rank)) for rank in (0, 1)]
            await asyncio.sleep(0.1)
            await llm.pause_generation(mode="wait")
            assert all(t.done() for t in waited)
            await llm.resume_generation()

            # abort: they end at once with finish_reason "abort".
            aborted = [asyncio.ensure_future(run(rank)) for rank in (0, 1)]
            await asyncio.sleep(0.1)
            await llm.pause_generation(mode="abort")
            assert [reason for _, reason in await asyncio.gather(*aborted)] == ["abort"] * 2
            await llm.resume_generation()
            assert not await llm.is_paused()

            # sleep on every rank; a request sent meanwhile runs after wake_up.
            await llm.sleep(1)
            assert await llm.is_sleeping()
            assert await llm.call_utility_all("get_sleep_level") == [1, 1]
            after_sleep = asyncio.ensure_future(run(0))
            await asyncio.sleep(0.2)
            assert not after_sleep.done()
            with pytest.raises(ValueError, match="asleep"):
                await llm.resume_generation()
            await llm.wake_up()
            assert not await llm.is_sleeping() and await after_sleep == (MAX_TOKENS, "length")

            blocks = llm.engine_core.num_blocks
            assert await llm.collective_rpc(rank_blocks) == [blocks[0], blocks[1]]
            assert await llm.collective_rpc("check_can_sleep", args=(1,)) == [None, None]
            with pytest.raises(ValueError, match="no public method"):
                await llm.collective_rpc("_update_states")
            await llm.start_weight_update()
            await llm.finish_weight_update("v1")
            assert await llm.call_utility_all("get_weight_version") == ["v1", "v1"]
            await wait_idle(llm)
            await assert_all_engines_idle(llm)


async def test_a_function_is_refused_by_engines_not_allowed_to_unpickle(monkeypatch):
    monkeypatch.delenv("MINICORE_ALLOW_INSECURE_SERIALIZATION", raising=False)
    async with dp_client(simulated_dp_config(2)) as llm:
        with pytest.raises(ValueError, match="MINICORE_ALLOW_INSECURE_SERIALIZATION=1"):
            await asyncio.wait_for(llm.collective_rpc(rank_blocks), TIMEOUT_S)
        with pytest.raises(ValueError, match="mode must be one of"):
            await llm.pause_generation(mode="soon")
        assert not await llm.is_paused()
        await assert_all_engines_idle(llm)
