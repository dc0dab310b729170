"""torch.distributed process groups built by hand: the rendezvous store, and a gloo or NCCL group
on it.

Mirrors create_tcp_store, init_gloo_process_group and the NCCL branch of
stateless_init_torch_distributed_process_group (vllm/distributed/utils.py). By hand, so that every
socket binds the DP address only (docs/DATA_PARALLEL.md, "What a deployment exposes"): the store
takes over a socket bound beforehand (by itself it listens on every interface), and gloo gets a
device made for that address (init_process_group ignores a gloo backend's options). The groups'
collectives are minicore/dp/group.py's.
"""

import contextlib
import socket
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, ProcessGroup, ProcessGroupGloo, TCPStore


def create_tcp_store(address: str, port: int, rank: int, size: int, timeout: timedelta,
                     listen_socket: socket.socket | None) -> TCPStore:
    """The group's rendezvous store at address:port, hosted by rank 0 on listen_socket (already
    bound, which the store takes over and closes when it goes). Returns once every rank has
    arrived and agrees on the size; a RuntimeError (DistError) after timeout otherwise."""
    listen_fd = listen_socket.detach() if listen_socket is not None else None
    store = TCPStore(address, port, world_size=size, is_master=rank == 0, timeout=timeout,
                     wait_for_workers=True, master_listen_fd=listen_fd, use_libuv=True)
    _check_same_size(store, rank, size)
    return store


def _check_same_size(store: TCPStore, rank: int, size: int) -> None:
    """The store counts arrivals only: ranks of different sizes would then wait in gloo's setup
    for ranks that never come, until its timeout. Rank 0's size against each rank's, so that both
    sides fail at once, naming the flag (as minicore/dp/fingerprint.py does the others)."""
    store.set(f"dp_size/{rank}", str(size))
    for peer in range(1, size) if rank == 0 else [0]:
        sizes = {rank: size, peer: int(store.get(f"dp_size/{peer}"))}
        if rank:
            store.set(f"dp_size_read/{rank}", "")
        if len(set(sizes.values())) > 1:
            if rank == 0:
                # Rank 0's store goes with its error: not before the peer has read rank 0's size,
                # or the peer's read fails and its error names no flag.
                with contextlib.suppress(RuntimeError):
                    store.wait([f"dp_size_read/{peer}"], timedelta(seconds=10))
            raise ValueError(f"DP ranks disagree on --data-parallel-size: rank 0 has {sizes[0]}, "
                             f"rank {max(sizes)} has {sizes[max(sizes)]}; start every rank with "
                             "the same engine arguments")


def init_gloo_process_group(store: TCPStore | PrefixStore, rank: int, size: int,
                            bind_address: str, timeout: timedelta) -> ProcessGroup:
    """A gloo process group whose sockets listen on bind_address."""
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=bind_address)]
    backend = ProcessGroupGloo(store, rank, size, options)  # connects to every peer
    backend._set_sequence_number_for_group()
    group = ProcessGroup(store, rank, size)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return group


def init_nccl_process_group(store: PrefixStore, rank: int, size: int, device: torch.device,
                            timeout: timedelta) -> ProcessGroup:
    """An NCCL process group on this rank's GPU (untested here: no GPU was at hand)."""
    from torch.distributed import ProcessGroupNCCL  # absent from CPU-only builds of torch

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    backend = ProcessGroupNCCL(store, rank, size, options)
    backend._set_sequence_number_for_group()
    group = ProcessGroup(store, rank, size)
    group._set_default_backend(ProcessGroup.BackendType.NCCL)
    group._register_backend(device, ProcessGroup.BackendType.NCCL, backend)
    return group
