"""Free ports, for whatever must be told a port before it binds one: the launcher of several API
servers (their engine sockets, with ranks on other machines), tests, benchmarks and examples.

Mirrors get_open_port (vllm/utils/network_utils.py). The engine processes never pick a port.
"""

import random
import socket


def free_port(span: int = 1) -> int:
    """A port P on 127.0.0.1 with P .. P + span - 1 free, just now (span 2: a DP deployment listens
    on P for the group's rendezvous and on P + 1 for the engines' handshake). It is drawn below the
    kernel's ephemeral range, so no outgoing connection's local port takes it before it is bound."""
    low = _ephemeral_port_range_start()
    for _ in range(200):
        port = random.randrange(10_000, low - span)
        if all(_bindable(port + i) for i in range(span)):
            return port
    raise RuntimeError(f"no {span} free consecutive ports found below {low}")


def free_port_pair() -> int:
    return free_port(span=2)


def _ephemeral_port_range_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts at 49152


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
