"""The data-parallel process group: torch.distributed over gloo, and every collective of the DP loop.

Mirrors ParallelConfig.stateless_init_dp_group (vllm/config/parallel.py) and
DPEngineCoreProc._has_global_unfinished_reqs (vllm/v1/engine/core.py), plus the running-count
gather of vllm-ascend's balance scheduling (PR #5212). gloo, so that it runs on CPU too; one group
per engine process. The collectives are the only way ranks talk during a wave:

  has_global_unfinished_reqs  all-reduce (MAX) of "this rank has unfinished requests"
  gather_running_counts       all-gather of len(running), for BalanceScheduler's gate
  max_step_time               all-reduce (MAX) of a simulated step's time (the lockstep that a
                              simulated model has no all-to-all for)

Each is a coroutine: the blocking call runs on one dedicated thread while the event loop keeps
socket IO flowing, and the busy loop awaits each before it issues the next, so every rank issues
them one at a time, in its loop's order (minicore/dp/engine.py states that order). A peer that dies
fails the pending collective within a second or so (gloo sees its sockets close); one that hangs
fails it after timeout_s. Left out: NCCL groups, several groups per process.
"""

import asyncio
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist


class DPGroup:
    def __init__(self, rank: int, size: int, address: str, port: int, timeout_s: float = 60.0):
        """Join the group: rank 0 hosts the rendezvous at address:port. Raises a RuntimeError
        naming the address when not every rank arrives within timeout_s."""
        self.rank, self.size = rank, size
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                                    world_size=size, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistError) as e:
            raise RuntimeError(f"DP rank {rank} of {size}: the group at tcp://{address}:{port} did "
                               f"not come together within {timeout_s:g} s: {e}") from e
        # A daemon thread: a collective stuck on a hung peer must not hold up the process's exit.
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve_calls, name=f"DP{rank}-collectives",
                                        daemon=True)
        self._thread.start()

    def check_same_config(self, values: dict[str, int]) -> None:
        """At startup, before any loop runs: all-gather settings that change which collectives a
        rank issues; a RuntimeError names the first that differs between ranks (a mismatch would
        otherwise be a hang)."""
        gathered = _all_gather(torch.tensor(list(values.values()), dtype=torch.int64), self.size)
        for i, name in enumerate(values):
            per_rank = [int(t[i]) for t in gathered]
            if len(set(per_rank)) > 1:
                raise RuntimeError(f"DP ranks disagree on {name}: {per_rank} (by rank); start "
                                   "every rank with the same engine arguments")

    async def has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        flag = torch.tensor([int(local_unfinished)], dtype=torch.int32)
        return bool(await self._run(_all_reduce_max, flag))

    async def gather_running_counts(self, num_running: int) -> list[int]:
        mine = torch.tensor([num_running], dtype=torch.int64)
        return [int(t) for t in await self._run(_all_gather, mine, self.size)]

    async def max_step_time(self, seconds: float) -> float:
        return float(await self._run(_all_reduce_max, torch.tensor([seconds], dtype=torch.float64)))

    async def _run(self, fn, *args):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((fn, args, future, loop))
        return await future

    def _serve_calls(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, args, future, loop = call
            try:
                result, error = fn(*args), None
            except Exception as e:
                result, error = None, e
            loop.call_soon_threadsafe(_settle, future, result, error)

    def destroy(self) -> None:
        self._calls.put(None)
        self._thread.join(timeout=1.0)
        if dist.is_initialized():
            dist.destroy_process_group()


def _all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def _all_gather(tensor: torch.Tensor, size: int) -> list[torch.Tensor]:
    gathered = [torch.zeros_like(tensor) for _ in range(size)]
    dist.all_gather(gathered, tensor)
    return gathered


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
