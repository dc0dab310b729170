"""The DP group with real processes and real gloo collectives: the unfinished-requests all-reduce,
the balance gather of a BalanceScheduler's len(running) and its all-reduce (MAX) alternative (all
awaited from an event loop), and a clear error when a rank never arrives (in the group, and at the
frontend); every socket of the group, and of the expert-parallel group made from it, listens on
the DP address only (ranks that disagree on their config: test_config_agreement.py). Every wait is
bounded."""

import asyncio
import multiprocessing
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from dp_helpers import free_port, free_port_pair

from minicore.config import CacheConfig, SchedulerConfig, create_engine_config
from minicore.dp.group import DPGroup
from minicore.engine.async_llm import AsyncLLM
from minicore.request import Request
from minicore.sampling_params import SamplingParams
from minicore.scheduler.balance import BalanceScheduler


def _rank_main(rank: int, size: int, port: int, results) -> None:
    group = DPGroup(rank, size, "127.0.0.1", port, timeout_s=30)
    scheduler = BalanceScheduler(SchedulerConfig(max_num_seqs=4), CacheConfig(num_blocks=64),
                                 dp_size=size)
    # Rank r runs r + 1 requests; only the last rank has unfinished work.
    for i in range(rank + 1):
        scheduler.add_request(Request(f"{rank}-{i}", [1, 2, 3], SamplingParams(max_tokens=8)))
    scheduler.schedule()

    async def loop_side():
        unfinished = await group.has_global_unfinished_reqs(rank == size - 1)
        idle = await group.has_global_unfinished_reqs(False)
        gathered = await group.gather_running_counts(len(scheduler.running))
        largest = await group.max_running_count(len(scheduler.running))
        return unfinished, idle, gathered, largest

    results.put((rank, *asyncio.run(loop_side())))
    group.destroy()


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_across_ranks(size):
    # Forked, as the suite's engines are (tests/conftest.py): no re-import of torch.
    ctx = multiprocessing.get_context("fork")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, results)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=60) for _ in range(size))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * size
    expected_counts = [r + 1 for r in range(size)]
    assert got == [(r, True, False, expected_counts, size) for r in range(size)]


def _lonely_rank(port: int, results) -> None:
    start = time.monotonic()
    try:
        DPGroup(0, 2, "127.0.0.1", port, timeout_s=2)
        results.put(("joined", 0.0))
    except RuntimeError as e:
        results.put((str(e), time.monotonic() - start))


def test_a_missing_rank_is_a_clear_error_not_a_hang():
    ctx = multiprocessing.get_context("fork")
    results, port = ctx.Queue(), free_port()
    proc = ctx.Process(target=_lonely_rank, args=(port, results))
    proc.start()
    try:
        message, elapsed = results.get(timeout=60)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    assert f"DP rank 0 of 2: the group at tcp://127.0.0.1:{port} did not come together" in message
    assert elapsed < 30


def _listening_rank(rank: int, port: int, results) -> None:
    group = DPGroup(rank, 2, "127.0.0.1", port, timeout_s=20)
    try:
        # After a collective every gloo connection is up; the second keeps rank 1 in the group
        # while rank 0 looks. The expert-parallel group (gloo on the CPU) is a second group of
        # the same ranks, with its own listener.
        asyncio.run(group.has_global_unfinished_reqs(False))
        ep_group = group.new_expert_parallel_group(torch.device("cpu"))
        ranks = torch.empty(2, dtype=torch.long)
        dist.all_gather_single(ranks, torch.tensor([rank]), group=ep_group)
        if rank == 0:
            results.put((ranks.tolist(), sorted(
                (c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN)))
        asyncio.run(group.has_global_unfinished_reqs(False))
    finally:
        group.destroy()


def test_the_group_listens_on_the_dp_address_only():
    # torch's own TCPStore listens on every interface (0.0.0.0 / ::), and gloo's sockets on
    # whatever the hostname resolves to: reachable by anyone who can reach the machine.
    ctx = multiprocessing.get_context("fork")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_listening_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        ep_ranks, listening = results.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert ep_ranks == [0, 1]
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
    assert ("127.0.0.1", port) in listening  # the store
    assert len(listening) >= 3  # and the two groups' gloo listeners


async def test_a_frontend_waiting_for_a_rank_that_never_starts_says_which_and_how():
    # Rank 1 is another machine's (--data-parallel-size-local 1) and is never started. The
    # timeout leaves rank 0 time to start and say HELLO on a loaded 2-core machine.
    config = create_engine_config(runner="simulated", data_parallel_size=2,
                                  data_parallel_size_local=1,
                                  data_parallel_rpc_port=free_port_pair())
    with pytest.raises(TimeoutError, match=r"HELLO from engine\(s\) \[1\].*ranks \[1\] are not "
                                           r"started here: start them with --headless"):
        await AsyncLLM.from_engine_config(config, startup_timeout=12)
