"""The data-parallel process group: torch.distributed over gloo, and every collective of the DP
loop.

Mirrors ParallelConfig.stateless_init_dp_group (vllm/config/parallel.py) and
DPEngineCoreProc._has_global_unfinished_reqs (vllm/v1/engine/core.py), plus the running-count
gather of vllm-ascend's balance scheduling (PR #5212). gloo, so that it runs on CPU too; one group
per engine process. The collectives are the only way ranks talk during a wave:

  has_global_unfinished_reqs  all-reduce (MAX) of "this rank has unfinished requests"
  gather_running_counts       all-gather of len(running), for BalanceScheduler's gate
  max_running_count           all-reduce (MAX) of len(running): all the gate reads, for less
                              (--balance-count-sync all-reduce-max)
  max_step_time               all-reduce (MAX) of a simulated step's time (the lockstep that a
                              simulated model has no all-to-all for)

At startup, before any of them, all_gather_json brings every rank's engine fingerprint to every
rank (minicore/dp/fingerprint.py). Each loop collective is a coroutine: the blocking call runs on
one dedicated thread while the event loop keeps socket IO flowing, and the busy loop awaits each
before it issues the next (minicore/dp/engine.py states their order). A dead peer fails the
pending collective within a second or so; a hung one after timeout_s. The group is built by hand,
so that every socket binds the DP address only (minicore/dp/process_groups.py). With expert
parallelism the same ranks form a second group for the model's own collectives
(new_expert_parallel_group). Left out: NCCL for the DP loop's own collectives (tiny; gloo runs
everywhere).
"""

import asyncio
import json
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup

from minicore.dp.process_groups import (
    create_tcp_store,
    init_gloo_process_group,
    init_nccl_process_group,
)
from minicore.utils import listen_on, local_address_towards


class DPGroup:
    def __init__(self, rank: int, size: int, address: str, port: int, timeout_s: float = 60.0):
        """Join the group: rank 0 hosts the rendezvous at address:port. Raises a RuntimeError
        naming the address when rank 0 cannot listen there, or when not every rank arrives within
        timeout_s."""
        self.rank, self.size = rank, size
        timeout = self._timeout = timedelta(seconds=timeout_s)
        self._expert_parallel_groups: list[ProcessGroup] = []
        # Bound before the store exists: a port in use is an error now, not a timeout later.
        listen_socket = (listen_on(address, port, "DP rank 0's rendezvous",
                                   "--data-parallel-rpc-port") if rank == 0 else None)
        try:
            self._store = create_tcp_store(address, port, rank, size, timeout, listen_socket)
            self._bind_address = local_address_towards(address)
            self._group = init_gloo_process_group(self._store, rank, size, self._bind_address,
                                                  timeout)
        except (RuntimeError, OSError) as e:  # DistError is a RuntimeError
            raise RuntimeError(f"DP rank {rank} of {size}: the group at tcp://{address}:{port} did "
                               f"not come together within {timeout_s:g} s: {e}") from e
        # A daemon thread: a collective stuck on a hung peer must not hold up the process's exit.
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve_calls, name=f"DP{rank}-collectives",
                                        daemon=True)
        self._thread.start()

    def all_gather_json(self, value) -> list:
        """At startup, before any loop runs: every rank's value, by rank (the ranks' fingerprints,
        minicore/dp/fingerprint.py). As JSON, not pickled: a peer's bytes are never code to run."""
        mine = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
        sizes = [int(n) for n in _all_gather(self._group, torch.tensor([len(mine)]))]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:len(mine)] = mine
        gathered = _all_gather(self._group, padded)
        return [json.loads(bytes(t[:n].tolist())) for t, n in zip(gathered, sizes, strict=True)]

    def new_expert_parallel_group(self, device: torch.device) -> ProcessGroup:
        """At startup, on every rank: a group of the same ranks for a mixture-of-experts model's
        collectives (minicore/model/expert_parallel.py), gloo on the CPU, NCCL on CUDA. Its own
        group, on the same rendezvous store under the prefix "ep": those collectives run on the
        forward thread, and a group matches its collectives by their order, so it must not be
        shared with the DP loop's. Destroyed with this group."""
        store = PrefixStore("ep", self._store)
        if device.type == "cuda":
            group = init_nccl_process_group(store, self.rank, self.size, device, self._timeout)
        else:
            group = init_gloo_process_group(store, self.rank, self.size, self._bind_address,
                                            self._timeout)
        self._expert_parallel_groups.append(group)
        return group

    async def has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        flag = torch.tensor([int(local_unfinished)], dtype=torch.int32)
        return bool(await self._run(_all_reduce_max, self._group, flag))

    async def gather_running_counts(self, num_running: int) -> list[int]:
        mine = torch.tensor([num_running], dtype=torch.int64)
        return [int(t) for t in await self._run(_all_gather, self._group, mine)]

    async def max_running_count(self, num_running: int) -> int:
        mine = torch.tensor([num_running], dtype=torch.int64)
        return int(await self._run(_all_reduce_max, self._group, mine))

    async def max_step_time(self, seconds: float) -> float:
        seconds = torch.tensor([seconds], dtype=torch.float64)
        return float(await self._run(_all_reduce_max, self._group, seconds))

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
        for group in self._expert_parallel_groups:
            group.shutdown()
        self._expert_parallel_groups.clear()
        if self._group is not None:
            self._group.shutdown()
            # Rank 0's store stops listening once the last reference (the group's) goes.
            self._group = self._store = None


def _all_reduce_max(group: ProcessGroup, tensor: torch.Tensor) -> float:
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.item()


def _all_gather(group: ProcessGroup, tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.zeros_like(tensor) for _ in range(group.size())]
    dist.all_gather(gathered, tensor, group=group)
    return gathered


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
