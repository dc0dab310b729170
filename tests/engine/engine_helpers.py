"""Helpers for the engine-process tests: a simulated-runner config, and a fake frontend (plain
sync ZMQ sockets) that talks to an engine process directly, to see exactly what it sends."""

import multiprocessing
import tempfile

import msgspec
import zmq

from minicore.config import create_engine_config
from minicore.model.config import SimulatedCost
from minicore.protocol import ENGINE_CORE_DEAD, EngineCoreOutputs, EngineCoreRequestType
from minicore.utils import make_zmq_socket


def simulated_config(step_s: float = 0.0, **engine_args):
    """A small engine on the SIMULATED runner (no weights; made-up tokens after step_s)."""
    engine_args.setdefault("kv_cache_memory", 64 << 20)
    return create_engine_config(runner="simulated", simulated_cost=SimulatedCost(step_s=step_s),
                                max_model_len=512, max_num_seqs=64, **engine_args)


class FakeFrontend:
    """The frontend side of the handshake and sockets, by hand. Use as a context manager: on exit
    the engine process is killed if it still runs, and the sockets are closed."""

    def __init__(self):
        self.tmpdir = tempfile.TemporaryDirectory(prefix="minicore-test-")
        self.ctx = zmq.Context()
        self.handshake_address = self._address("handshake")
        self.handshake = make_zmq_socket(self.ctx, self.handshake_address, zmq.ROUTER, bind=True)
        self.input = make_zmq_socket(self.ctx, self._address("input"), zmq.ROUTER, bind=True)
        self.output = make_zmq_socket(self.ctx, self._address("output"), zmq.PULL, bind=True)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.proc = None

    def _address(self, name: str) -> str:
        return f"ipc://{self.tmpdir.name}/{name}"

    def start(self, target, config, **kwargs) -> multiprocessing.Process:
        self.proc = multiprocessing.get_context("spawn").Process(
            target=target, args=(config, self.handshake_address), kwargs=kwargs, daemon=True)
        self.proc.start()
        return self.proc

    def recv(self, sock: zmq.Socket, timeout: float) -> list[bytes]:
        assert sock.poll(timeout=int(timeout * 1000)), "nothing received in time"
        return sock.recv_multipart()

    def hello(self, timeout: float = 30) -> tuple[bytes, dict]:
        identity, payload = self.recv(self.handshake, timeout)
        return identity, msgspec.msgpack.decode(payload)

    def complete_handshake(self, timeout: float = 30) -> dict:
        """HELLO, addresses, READY and the engine's first input frame; returns READY."""
        identity, hello = self.hello(timeout)
        assert hello["status"] == "HELLO"
        self.identity = identity
        self.handshake.send_multipart([identity, msgspec.msgpack.encode(
            {"inputs": [self._address("input")], "outputs": [self._address("output")]})])
        _, ready = self.recv(self.handshake, timeout)
        assert self.recv(self.input, timeout) == [identity, b""]
        return msgspec.msgpack.decode(ready)

    def send(self, request_type: EngineCoreRequestType, payload) -> None:
        self.send_raw(request_type.value, self.encoder.encode(payload))

    def send_raw(self, *frames: bytes) -> None:
        self.input.send_multipart([self.identity, *frames])

    def next_output(self, timeout: float = 10) -> EngineCoreOutputs | bytes:
        (frame,) = self.recv(self.output, timeout)
        # ENGINE_CORE_DEAD (with the engine's index) comes back raw.
        return frame if frame.startswith(ENGINE_CORE_DEAD) else self.decoder.decode(frame)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(10)
        self.ctx.destroy(linger=0)
        self.tmpdir.cleanup()
