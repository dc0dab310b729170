"""Shared helpers for the data-parallel tests: free port pairs, simulated DP configs, a client that
is always shut down (its engine processes joined), its engines' logs, bounded polling, and the
simulated model's expected tokens. Every wait here has a deadline, so a hung rank fails a test
instead of CI."""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from minicore.config import create_engine_config
from minicore.engine.async_llm import AsyncLLM
from minicore.model.config import SimulatedCost
from minicore.model.simulated import next_token, read_vocab
from minicore.ports import free_port, free_port_pair  # noqa: F401  (the DP tests import it from here)

STARTUP_TIMEOUT_S = 120
# Waves end at the every-32-steps sync: even slow steps on a loaded machine end one well within
# this.
IDLE_TIMEOUT_S = 15


def simulated_dp_config(data_parallel_size: int, *, step_s: float = 0.002, **engine_args):
    """A DP config on the SIMULATED runner (no weights; made-up tokens after step_s per step) on
    fresh ports."""
    return create_engine_config(runner="simulated", simulated_cost=SimulatedCost(step_s=step_s),
                                data_parallel_size=data_parallel_size,
                                data_parallel_rpc_port=free_port_pair(), **engine_args)


@contextlib.contextmanager
def engine_log(path):
    """Logs at INFO, this process's and its engines', appended to path while open: the engines
    are forked (tests/conftest.py) and keep this process's logging, not stderr as a spawned one's
    (where capfd would read it)."""
    root = logging.getLogger()
    handler, level = logging.FileHandler(path), root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield path
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


@contextlib.asynccontextmanager
async def dp_client(config):
    """An AsyncLLM with one engine process per DP rank; at exit it is shut down and every
    engine process must have exited."""
    client = await asyncio.wait_for(AsyncLLM.from_engine_config(config), STARTUP_TIMEOUT_S)
    try:
        yield client
    finally:
        await client.shutdown()
        alive = [rank for rank, proc in client.engine_core.procs.items() if proc.exitcode is None]
        assert not alive, f"engine processes of ranks {alive} outlived the shutdown"


async def wait_until(condition: Callable[[], bool], timeout: float, what: str,
                     interval: float = 0.005) -> float:
    """Poll condition until it holds; returns the seconds it took, AssertionError after timeout."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(interval)
    return time.monotonic() - start


async def wait_idle(client: AsyncLLM, timeout: float = IDLE_TIMEOUT_S) -> float:
    """Wait until the frontend has heard that the wave completed (rank 0's wave_complete)."""
    return await wait_until(lambda: not client.engine_core.coordinator.engines_running, timeout,
                            "the DP wave completes (coordinator.engines_running turns False)")


def simulated_tokens(client: AsyncLLM, prompt: list[int], n: int) -> list[int]:
    """The n tokens the simulated runner generates after prompt (it reads the same vocab)."""
    vocab_size, eos_ids = read_vocab(client.config.model_config.model)
    token_ids = list(prompt)
    for _ in range(n):
        token_ids.append(next_token(token_ids, vocab_size, eos_ids))
    return token_ids[len(prompt):]


async def assert_all_engines_idle(client: AsyncLLM, timeout: float = 10) -> None:
    """Every rank answers (a rank stuck in a collective would not: its busy loop handles utility
    calls), holds no request, and its process is alive."""
    for rank in range(client.num_engines):
        stats = await asyncio.wait_for(client.call_utility("get_stats", engine_index=rank),
                                       timeout)
        assert stats["request_ids"] == [], f"rank {rank} still holds {stats['request_ids']}"
        assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (0, 0), (rank, stats)
    dead = [rank for rank, proc in client.engine_core.procs.items() if not proc.is_alive()]
    assert not dead and client.is_healthy, (
        f"engine ranks {dead} died ({client.engine_core._dead_reason})")
    assert client.output_processor.request_states == {}


def token_prompts(model_dir: str, lengths: list[int]) -> list[list[int]]:
    """A prompt of token ids of each length, spread over the model's vocabulary (the first
    three ids left out)."""
    vocab_size, _ = read_vocab(model_dir)
    return [[(7 * i + 3 * j) % (vocab_size - 3) + 3 for j in range(length)]
            for i, length in enumerate(lengths)]


def one_engine_tokens(model_dir: str, prompts: list[list[int]], params,
                      **engine_args) -> list[list[int]]:
    """The token ids one in-process engine gives the prompts (params: one SamplingParams, or
    one each)."""
    from minicore.llm import LLM

    outputs = LLM(model_dir, **engine_args).generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]
