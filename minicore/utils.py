"""Small helpers shared by the frontend and the engine processes: ZMQ sockets, free ports and the
GC heap.

Mirrors make_zmq_socket and get_open_port (vllm/utils/network_utils.py) and freeze_gc_heap
(vllm/utils/gc_utils.py). Left out: socket buffer tuning, IPv6 address parsing.
"""

import gc
import socket

import zmq


def make_zmq_socket(ctx: zmq.Context, address: str, socket_type: int, *, bind: bool,
                    identity: bytes | None = None, linger: int = 0, rcvhwm: int = 0,
                    max_msg_size: int = -1) -> zmq.Socket:
    """rcvhwm and max_msg_size (-1: none) bound what a socket that reads little may queue; they
    must be set before bind or connect to apply to the connections made then."""
    sock = ctx.socket(socket_type)
    # No high-water marks by default: past one a ROUTER drops messages silently, and no message
    # may be lost.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    sock.setsockopt(zmq.LINGER, linger)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def free_port_pair() -> int:
    """A port P on 127.0.0.1 with P + 1 free too, just now: a DP deployment listens on both (the
    group's rendezvous on P, the engines' handshake on P + 1), as do a NIXL side channel's peers."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port + 1 >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free pair of consecutive ports found")


def freeze_gc_heap() -> None:
    """Move everything alive now (after startup: torch, transformers, the model, the tokenizer; a
    large, static heap) out of the garbage collector's reach: a full collection over it stalls the
    event loop (docs/BENCHMARKS.md has the figures)."""
    gc.collect()
    gc.freeze()
