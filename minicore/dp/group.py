"""The data-parallel process group: torch.distributed over gloo, and the collectives of the DP loop.

Mirrors ParallelConfig.stateless_init_dp_group (vllm/config/parallel.py) and
DPEngineCoreProc._has_global_unfinished_reqs (vllm/v1/engine/core.py, seed 003), plus the running
count gather of vllm-ascend's balance scheduling (seed 000). gloo, so that it runs on CPU too; one
group per engine process. The collectives block, so the event loop awaits them on one dedicated
thread: socket IO keeps flowing, and the collectives still run one at a time in the order the busy
loop issues them, which every rank must share. A peer that dies fails the pending collective within
a second or so (gloo sees its sockets close); one that hangs fails it after timeout_s. Left out:
NCCL groups, several groups per process.
"""

import asyncio
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from minicore.scheduler import BalanceScheduler


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
        """All-gather settings that change which collectives a rank issues; a RuntimeError names
        the first that differs between ranks (a mismatch would otherwise be a hang)."""
        mine = torch.tensor(list(values.values()), dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(gathered, mine)
        for i, name in enumerate(values):
            per_rank = [int(t[i]) for t in gathered]
            if len(set(per_rank)) > 1:
                raise RuntimeError(f"DP ranks disagree on {name}: {per_rank} (by rank); start "
                                   "every rank with the same engine arguments")

    def has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        """All-reduce (MAX) of "this rank has unfinished requests"."""
        flag = torch.tensor([int(local_unfinished)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    async def has_global_unfinished_reqs_async(self, local_unfinished: bool) -> bool:
        return await self._run(self.has_global_unfinished_reqs, local_unfinished)

    async def balance_gather_async(self, scheduler: BalanceScheduler) -> None:
        """BalanceScheduler.balance_gather (all-gather of len(running)), off the event loop."""
        await self._run(scheduler.balance_gather, dist.group.WORLD)

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


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
