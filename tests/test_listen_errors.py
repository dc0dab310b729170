"""minicore.utils' listeners: a port in use, or an address not this machine's, is a ListenError
whose one line names the port, what listens there and the setting to change; the failed socket is
closed, so the same context still terminates (end to end: tests/entrypoints/test_port_clashes.py).
"""

import socket

import pytest
import zmq

from minicore.ports import free_port_pair
from minicore.utils import ListenError, bind_zmq_socket, listen_on

# TEST-NET-1 (RFC 5737): never an address of this machine.
NOT_HERE = "192.0.2.1"


@pytest.fixture
def held_port():
    port = free_port_pair()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield port


def test_listen_on_names_the_setting_when_the_port_is_in_use(held_port):
    with pytest.raises(ListenError) as failed:
        listen_on("127.0.0.1", held_port, "the test's listener", "--test-port")
    assert str(failed.value) == (f"--test-port {held_port}: address 127.0.0.1:{held_port} (the "
                                 "test's listener) is in use; choose another with --test-port")


def test_listen_on_an_address_of_another_machine():
    with pytest.raises(ListenError, match=rf"the test's listener cannot listen on {NOT_HERE}:\d+: "
                                          r".* \(not an address of this machine\)$"):
        listen_on(NOT_HERE, free_port_pair(), "the test's listener", "--test-port")


def test_bind_zmq_socket_names_the_setting_and_its_value(held_port):
    ctx = zmq.Context()
    with pytest.raises(ListenError) as failed:
        bind_zmq_socket(ctx, zmq.ROUTER, "127.0.0.1", held_port, "the test's handshake",
                        "--test-port", value=held_port - 1, how=" (or TEST_PORT)")
    assert str(failed.value) == (
        f"--test-port {held_port - 1}: address 127.0.0.1:{held_port} (the test's handshake) is in "
        "use; choose another with --test-port (or TEST_PORT)")
    ctx.term()  # would block on a socket left open
