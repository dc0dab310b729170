"""Small helpers shared by the frontend and the engine processes: ZMQ sockets, listening sockets,
free ports and the GC heap.

Mirrors make_zmq_socket and get_open_port (vllm/utils/network_utils.py) and freeze_gc_heap
(vllm/utils/gc_utils.py). Left out: socket buffer tuning, IPv6 address parsing.
"""

import errno
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


def listen_on(address: str, port: int, what: str, setting: str) -> socket.socket:
    """A TCP socket listening on address:port only, for what; a RuntimeError naming the setting
    that chooses the port when it is in use, or the address when it is not this machine's."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # A port left in TIME_WAIT by the previous server is fine; one in use is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        hint = {errno.EADDRINUSE: f" (in use by another server? choose another with {setting})",
                errno.EADDRNOTAVAIL: " (not an address of this machine)"}.get(e.errno, "")
        raise RuntimeError(f"{what} cannot listen on {address}:{port}: {e}{hint}") from None
    return sock


def local_address_towards(address: str) -> str:
    """address itself where it is one of this machine's, else the local address this machine
    reaches it from (no packet is sent)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, 0, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((sockaddr[0], 0))
            return sockaddr[0]
        except OSError:
            probe.connect(sockaddr)
            return probe.getsockname()[0]
