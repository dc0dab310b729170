"""Small helpers shared by the frontend and the engine processes: ZMQ sockets, listening sockets
and the GC heap.

Mirrors make_zmq_socket (vllm/utils/network_utils.py) and freeze_gc_heap
(vllm/utils/gc_utils.py). Every listener a deployment opens on a port it is told (the DP
rendezvous, the engines' handshake, a NIXL side channel) is bound with listen_on or
bind_zmq_socket, at startup, in the thread that starts it: a port in use is then a ListenError, one
line naming the port and the setting that chooses it, that fails the startup. Left out: socket
buffer tuning, IPv6 address parsing.
"""

import errno
import gc
import socket

import zmq


def make_zmq_socket(ctx: zmq.Context, address: str, socket_type: int, *, bind: bool,
                    identity: bytes | None = None, linger: int = 0, rcvhwm: int = 0,
                    sndhwm: int = 0, max_msg_size: int = -1) -> zmq.Socket:
    """rcvhwm, sndhwm and max_msg_size (-1: none) bound what a socket that reads little, or
    answers peers it does not trust, may queue; they must be set before bind or connect to apply
    to the connections made then."""
    sock = ctx.socket(socket_type)
    # No high-water marks by default: past one a ROUTER drops messages silently, and no message
    # may be lost.
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    sock.setsockopt(zmq.LINGER, linger)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    try:
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except zmq.ZMQError:
        sock.close()  # else the context's term() waits for it
        raise
    return sock


class ListenError(RuntimeError):
    """A listener could not start. The message says it all (which port or address, what listens
    there, the setting to change): startup reports it as one line, without a traceback."""


def listen_error(error: OSError | zmq.ZMQError, host: str, port: int | str, what: str,
                 setting: str, value: int | None = None, how: str = "") -> ListenError:
    """The ListenError for what failing to listen on host:port. setting chooses the port, value
    is what it was given (the port itself by default: some listeners add an offset); how, where
    to set it when the setting is no flag of its own."""
    if error.errno == errno.EADDRINUSE:
        return ListenError(f"{setting} {port if value is None else value}: address {host}:{port} "
                           f"({what}) is in use; choose another with {setting}{how}")
    hint = " (not an address of this machine)" if error.errno == errno.EADDRNOTAVAIL else ""
    return ListenError(f"{what} cannot listen on {host}:{port}: {error.strerror}{hint}")


def bind_zmq_socket(ctx: zmq.Context, socket_type: int, host: str, port: int | str, what: str,
                    setting: str, *, value: int | None = None, how: str = "",
                    **options) -> zmq.Socket:
    """make_zmq_socket bound to tcp://host:port (port "*": a free one), for what; a ListenError
    (listen_error) when it cannot bind."""
    try:
        return make_zmq_socket(ctx, f"tcp://{host}:{port}", socket_type, bind=True, **options)
    except zmq.ZMQError as e:
        raise listen_error(e, host, port, what, setting, value, how) from None


def freeze_gc_heap() -> None:
    """Move everything alive now (after startup: torch, transformers, the model, the tokenizer; a
    large, static heap) out of the garbage collector's reach: a full collection over it stalls the
    event loop (docs/BENCHMARKS.md has the figures)."""
    gc.collect()
    gc.freeze()


def listen_on(address: str, port: int, what: str, setting: str,
              reuse_port: bool = False) -> socket.socket:
    """A TCP socket listening on address:port only, for what; a ListenError (a RuntimeError)
    naming the setting that chooses the port when it is in use, or the address when it is not
    this machine's. reuse_port: one of several on the port, the kernel spreading connections."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # A port left in TIME_WAIT by the previous server is fine; one in use is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, reuse_port)
            sock.bind(sockaddr)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        raise listen_error(e, address, port, what, setting) from None
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
