"""Balance scheduling's gate, live: DP=2 engine processes on the SIMULATED runner, max_num_seqs=4.

While any rank runs at the threshold ("full": max_num_seqs = 4, "one-short": 3), no rank admits a
waiting request, not even an idle one; without balance scheduling every rank admits at once. The
gated scenarios run with both ways of sharing the running counts (--balance-count-sync): the gate
reads only their maximum, so the all-reduce (MAX) must gate exactly as the all-gather does. Rank 0
is filled with long requests (100 steps of 10 ms: a second or more), then short ones are sent; the
tests assert on ordering, not durations: a gated short request gets its first token only after a
long one finished, an ungated one (and its whole run) before any long one finished. The times are
the engines' own frame timestamps (time.monotonic(), one clock on one machine), so frontend
lag cannot reorder them, and the gate's release is causal: rank 1 admits only after the gather
that follows the step where rank 0's long request finished.
"""

import asyncio
import time

import pytest
from dp_helpers import dp_client, simulated_dp_config, wait_idle, wait_until

from minicore.engine.async_llm import AsyncLLM
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

LONG_TOKENS = 100
SHORT_TOKENS = 4
STEP_S = 0.01
SCENARIO_TIMEOUT_S = 60


COUNT_SYNCS = ["all-gather", "all-reduce-max"]


def gate_config(balance: bool, threshold: str = "full", count_sync: str = "all-gather"):
    return simulated_dp_config(2, step_s=STEP_S, max_num_seqs=4, balance_scheduling=balance,
                               balance_threshold=threshold, balance_count_sync=count_sync)


class EngineTimes:
    """A tap on the client's engine frames: the engine's timestamp of each request's first token
    and of its finish."""

    def __init__(self, client: AsyncLLM):
        self.first_token: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        self._handle = client._process_outputs

    def __call__(self, outputs):
        for output in outputs.outputs:
            if output.new_token_ids:
                self.first_token.setdefault(output.request_id, outputs.timestamp)
            if output.finished:
                self.finished[output.request_id] = outputs.timestamp
        self._handle(outputs)


def num_running(client: AsyncLLM, rank: int) -> int:
    stats = client.latest_stats.get(rank)  # none before the engine's first frame
    return 0 if stats is None else stats.num_running_reqs


async def run_to_end(client: AsyncLLM, request_id: str, rank: int, max_tokens: int):
    outputs = [o async for o in client.generate([7, 8, 9, len(request_id)],
                                                SamplingParams(max_tokens=max_tokens),
                                                request_id, data_parallel_rank=rank)]
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == max_tokens, request_id


async def fill_then_send(client: AsyncLLM, num_long: int, short_ranks: list[int],
                         tag: str) -> tuple[EngineTimes, list[str], list[str]]:
    """num_long long requests on rank 0; once rank 0 runs them all, one short request to each of
    short_ranks. Returns the engine times and the long and short request ids."""
    await wait_idle(client)
    times = EngineTimes(client)
    client._process_outputs = times
    longs = [f"{tag}-long-{i}" for i in range(num_long)]
    shorts = [f"{tag}-short-rank{r}" for r in short_ranks]
    try:
        async def scenario():
            tasks = [asyncio.create_task(run_to_end(client, rid, 0, LONG_TOKENS)) for rid in longs]
            await wait_until(lambda: num_running(client, 0) == num_long, 15,
                             f"rank 0 runs the {num_long} long requests")
            tasks += [asyncio.create_task(run_to_end(client, rid, rank, SHORT_TOKENS))
                      for rid, rank in zip(shorts, short_ranks)]
            await asyncio.gather(*tasks)

        await asyncio.wait_for(scenario(), SCENARIO_TIMEOUT_S)
    finally:
        del client._process_outputs
    first_long_done = min(times.finished[rid] for rid in longs)
    for rid in shorts:
        print(f"{rid}: first token {times.first_token[rid] - first_long_done:+.3f} s after the "
              "first long request finished")
    return times, longs, shorts


def assert_gated(times: EngineTimes, longs: list[str], shorts: list[str]) -> None:
    first_long_done = min(times.finished[rid] for rid in longs)
    for rid in shorts:
        assert times.first_token[rid] > first_long_done, (
            f"{rid} got its first token {first_long_done - times.first_token[rid]:.3f} s before "
            "any long request finished: it was admitted while rank 0 was at the threshold")


def assert_admitted_at_once(times: EngineTimes, longs: list[str], shorts: list[str]) -> None:
    first_long_done = min(times.finished[rid] for rid in longs)
    for rid in shorts:
        # Its whole run (SHORT_TOKENS steps), not just its first token, fits before the long
        # requests' remaining ~100 steps.
        assert times.finished[rid] < first_long_done, (
            f"{rid} finished {times.finished[rid] - first_long_done:.3f} s after the first long "
            "request: it was held back")


@pytest.mark.parametrize("count_sync", COUNT_SYNCS)
async def test_one_short_threshold_holds_back_every_rank(count_sync):
    """3 running on rank 0 (= max_num_seqs - 1): neither rank 1 (idle) nor rank 0 (a free slot)
    admits until a long request finishes."""
    async with dp_client(gate_config(True, "one-short", count_sync)) as client:
        assert_gated(*await fill_then_send(client, 3, [1, 0], "one-short"))


async def test_without_balance_every_rank_admits_at_once():
    async with dp_client(gate_config(balance=False)) as client:
        assert_admitted_at_once(*await fill_then_send(client, 3, [1, 0], "off"))


@pytest.mark.parametrize("count_sync", COUNT_SYNCS)
async def test_full_threshold_gates_only_a_full_rank(count_sync):
    """"full": 3 running on rank 0 leaves rank 1 free to admit; 4 (a full rank) closes the gate."""
    async with dp_client(gate_config(True, "full", count_sync)) as client:
        assert_admitted_at_once(*await fill_then_send(client, 3, [1], "three"))
        start = time.monotonic()
        assert_gated(*await fill_then_send(client, 4, [1], "four"))
        print(f"the gated scenario took {time.monotonic() - start:.2f} s")
