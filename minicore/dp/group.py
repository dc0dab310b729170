"""The data-parallel process group: torch.distributed over gloo, and the collectives of the DP loop.

Mirrors ParallelConfig.stateless_init_dp_group (vllm/config/parallel.py) and
DPEngineCoreProc._has_global_unfinished_reqs (vllm/v1/engine/core.py, seed 003), plus the running
count gather of vllm-ascend's balance scheduling (seed 000). gloo, so that it runs on CPU too; one
group per engine process. The collectives block, so the event loop awaits them on one dedicated
thread: socket IO keeps flowing, and the collectives still run one at a time in the order the busy
loop issues them, which every rank must share. Left out: NCCL groups, several groups per process.
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor
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
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"DP{rank}-collectives")

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
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def destroy(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if dist.is_initialized():
            dist.destroy_process_group()
