"""vLLM's weight transfer engine: a trainer process broadcasts new weights to every engine rank,
which loads them in place.

Mirrors vllm/distributed/weight_transfer/ (NCCLWeightTransferEngine: its trainer_init, and
receive_weights behind POST /update_weights) and its payloads: init_info {master_address,
master_port, rank_offset, world_size}, update_info {names, dtype_names, shapes}. The group is
NCCL's between GPUs, as vLLM's, and gloo's on CPU (the tensors go over TCP): each end picks by its
device (an engine's: its runner's; the trainer's: trainer_init's device, CUDA where there is one),
so a GPU trainer of CPU engines passes device="cpu". The trainer is rank 0 and hosts the
rendezvous store; DP engine i joins as rank_offset + i; an update is one broadcast from rank 0 per
tensor, in the order of names. Left out: CUDA IPC handles for a colocated trainer, packed
(bucketed) tensors. The NCCL path is untested here: no GPU was at hand.

    group = trainer_init({"master_address": "127.0.0.1", "master_port": port, "world_size": 3})
    # ... POST /init_weight_transfer_engine with the same init_info and rank_offset 1 ...
    group.send(model.named_parameters())  # beside POST /update_weights {"update_info": ...}
"""

import socket
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, TCPStore

from minicore.dp.process_groups import init_gloo_process_group, init_nccl_process_group

DEFAULT_TIMEOUT = timedelta(seconds=300)


class WeightTransferGroup:
    """One rank's end of the group (rank 0: the trainer's)."""

    def __init__(self, init_info: dict, rank: int, device: torch.device,
                 timeout: timedelta = DEFAULT_TIMEOUT):
        """Join the group init_info describes as rank, on device's backend; returns once every
        rank has joined."""
        address, port, size = _parse_init_info(init_info)
        if not 0 <= rank < size:
            raise ValueError(f"init_info: rank {rank} is outside world_size {size} (the trainer "
                             "is rank 0, the engines rank_offset, rank_offset + 1, ...)")
        self.rank, self.world_size, self.device = rank, size, device
        store = PrefixStore("weight_transfer", TCPStore(
            address, port, world_size=size, is_master=rank == 0, timeout=timeout,
            wait_for_workers=True))
        self._group = (init_nccl_process_group(store, rank, size, device, timeout)
                       if device.type == "cuda" else init_gloo_process_group(
                           store, rank, size, _local_address(address, port), timeout))
        self._store = store  # rank 0 hosts it: kept for the group's life

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The trainer's side of an update: every tensor, in order (the update_info it posts
        names them in the same order)."""
        for _, tensor in named_tensors:
            self._group.broadcast(tensor.detach().contiguous().to(self.device), 0).wait()

    def receive(self, update_info: dict) -> list[tuple[str, torch.Tensor]]:
        """An engine's side: the tensors update_info announces, as the trainer broadcasts them."""
        names, dtypes, shapes = _parse_update_info(update_info)
        received = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            self._group.broadcast(tensor, 0).wait()
            received.append((name, tensor))
        return received

    def update_info(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """The update_info that announces these tensors (the trainer posts it)."""
        named = list(named_tensors)
        return {"names": [n for n, _ in named],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named]}


def trainer_init(init_info: dict, timeout: timedelta = DEFAULT_TIMEOUT,
                 device: torch.device | str | None = None) -> WeightTransferGroup:
    """The trainer's end, rank 0 (vLLM: NCCLWeightTransferEngine.trainer_init), on device
    (default: this process's GPU where it has one, else the CPU)."""
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return WeightTransferGroup(init_info, 0, torch.device(device), timeout)


def join_as_engine(init_info: dict, dp_rank: int, device: torch.device) -> Future:
    """DP engine dp_rank's end, rank init_info["rank_offset"] (default 1) + dp_rank: a future of
    the group, joined on a thread of its own. Joining waits for every rank, and meanwhile the
    engine's forward thread must stay free: a DP rank may be waiting there, in a collective of
    the DP group, for a peer that has not reached the join yet. A bad init_info is refused now."""
    _parse_init_info(init_info)
    rank = init_info.get("rank_offset", 1) + dp_rank
    future: Future = Future()

    def join() -> None:
        try:
            future.set_result(WeightTransferGroup(init_info, rank, device))
        except BaseException as e:  # the update that waits for it reports it
            future.set_exception(e)
    threading.Thread(target=join, name="weight-transfer-join", daemon=True).start()
    return future


def _parse_init_info(init_info) -> tuple[str, int, int]:
    if not isinstance(init_info, dict):
        raise ValueError("init_info must be an object: {master_address, master_port, "
                         "rank_offset, world_size}")
    address, port, size = (init_info.get(k) for k in ("master_address", "master_port",
                                                      "world_size"))
    if not isinstance(address, str) or not address:
        raise ValueError(f"init_info.master_address must be a host, got {address!r}")
    for name, value in (("master_port", port), ("world_size", size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"init_info.{name} must be a positive integer, got {value!r}")
    return address, port, size


def _parse_update_info(update_info) -> tuple[list[str], list[torch.dtype], list[list[int]]]:
    names, dtype_names, shapes = (update_info.get(k) for k in ("names", "dtype_names", "shapes"))
    if not (isinstance(names, list) and isinstance(dtype_names, list) and isinstance(shapes, list)
            and len(names) == len(dtype_names) == len(shapes)):
        raise ValueError("update_info must hold names, dtype_names and shapes: lists of one "
                         "length")
    dtypes = []
    for name in dtype_names:
        dtype = getattr(torch, str(name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"update_info.dtype_names: {name!r} is not a torch dtype")
        dtypes.append(dtype)
    return names, dtypes, shapes


def _local_address(master_address: str, master_port: int) -> str:
    """The address this host reaches the master from (gloo binds its sockets there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(master_address), master_port))
        return probe.getsockname()[0]
