"""The frontend's side of the engine sockets: requests out, outputs in, engines watched.

Mirrors AsyncMPClient in vllm/v1/engine/core_client.py. make_async_mp_client starts this
machine's engine processes (minicore/engine/launch.py), then binds the sockets every engine
connects to (ranks on other machines too), and waits for each engine's READY; an API server of
several attaches to engines its launcher started (attach). Requests and aborts leave on a ROUTER
socket (msgspec msgpack, one frame per message, never blocking), outputs arrive on a PULL socket.
With data parallelism, DPLBAsyncMPClient (minicore/dp/client.py) picks each request's engine and
keeps the engines' waves going.

Supervision: when a local engine process exits, a remote engine (a headless DP rank) sends
ENGINE_CORE_DEAD, or a send to an engine fails, the client turns dead: it stops the other local
engines (DP ranks cannot go on without a peer), fails pending utility calls, and tells its owner
through on_dead, which fails the requests in flight. An engine alive but silent, not even
answering a ping, for MINICORE_ENGINE_ITERATION_TIMEOUT_S (60 s) is declared hung, to the same
effect (EngineWatchdog, minicore/dp/coordinator.py). No other frame can do that: one that does not
decode, or names no engine, is dropped (logged, rate-limited), and a local ENGINE_CORE_DEAD only
announces the exit the process watch then sees. The input ROUTER reads nothing after startup (a
few small frames per peer at most). Left out: elastic scaling, socket authentication
(docs/DATA_PARALLEL.md says what is exposed).
"""

import asyncio
import functools
import itertools
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from minicore.config import EngineConfig
from minicore.dp.coordinator import make_watchdog
from minicore.engine.launch import CoreEngineProcManager, wait_for_engine_startup
from minicore.engine.worker_rpc import encode_callable
from minicore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    parse_engine_dead_frame,
)
from minicore.utils import listen_error, make_zmq_socket

logger = logging.getLogger(__name__)

# The input ROUTER only ever receives each engine's empty first frame: anything more from a peer
# waits in a queue this short, of frames this small, and then the peer is held back.
INPUT_RCVHWM = 16
INPUT_MAX_MSG_BYTES = 1024


class EngineDeadError(RuntimeError):
    """The engine process died: in-flight and later requests fail with this."""


async def make_async_mp_client(config: EngineConfig, startup_timeout: float,
                               client_cls: type["AsyncMPClient"]) -> "AsyncMPClient":
    """Start the engines and wait until every one (local or not) is READY. client_cls:
    AsyncMPClient, or for data parallelism DPLBAsyncMPClient (minicore/dp/client.py)."""
    client = client_cls(config)
    try:
        await client.start(startup_timeout)
    except BaseException:
        await client.shutdown()
        raise
    return client


class AsyncMPClient:
    def __init__(self, config: EngineConfig):
        self.config = config
        # The DP ranks this frontend sends requests to: its engines 0 .. num_engines - 1 are
        # ranks first_rank, first_rank + 1, ... (all of them but with external or hybrid load
        # balancing), as engine frames and the handshake's numbers are translated on arrival.
        ranks = config.parallel_config.engine_ranks
        self.num_engines, self.first_rank = len(ranks), ranks.start
        # Each engine's KV cache blocks, from its READY.
        self.num_blocks: dict[int, int] = {}
        # Called once, with the error, when the client turns dead.
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self.manager: CoreEngineProcManager | None = None
        # Chosen once: it pings quiet engines and declares the silent ones hung (set_dead).
        self.watchdog = make_watchdog(self.num_engines, self._ping, self._frames_pending,
                                      self.set_dead)
        self._last_frame = self.watchdog.last_frame
        self._dead_reason: str | None = None
        self._shutting_down = False
        # Set by expect_engine_exit: engines stopping now are no error to log.
        self._exit_expected = False
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        # collective_rpc's callables travel pickled (the engine unpickles only where allowed).
        self._encoder = msgspec.msgpack.Encoder(enc_hook=encode_callable)
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._identities = [rank.to_bytes(2, "little") for rank in ranks]
        self._num_dropped = 0
        # Private to this user (mode 0700): no other user can reach the ipc sockets in it.
        self._tmpdir = tempfile.mkdtemp(prefix="minicore-")
        self.ctx = zmq.Context()
        self.output_socket: zmq.asyncio.Socket | None = None
        # Resolves, with the reason, when the first local engine process exits.
        self._engine_exited = asyncio.get_running_loop().create_future()

    @property
    def procs(self) -> dict:
        """This machine's engine processes, by DP rank (ranks on other machines have none)."""
        return self.manager.procs if self.manager is not None else {}

    # ---- startup -------------------------------------------------------------------------------

    def _address(self, name: str) -> str:
        """ipc for engines of this machine only (one engine, or external or hybrid load
        balancing); tcp for all DP ranks, some maybe elsewhere (the handshake at rpc_port + 1)."""
        pc = self.config.parallel_config
        if self.num_engines < pc.data_parallel_size or self.num_engines == 1:
            return f"ipc://{self._tmpdir}/{name}"
        if name == "handshake":
            return f"tcp://{pc.data_parallel_address}:{pc.data_parallel_rpc_port + 1}"
        return f"tcp://{pc.data_parallel_address}:*"

    def _bind(self, socket_type: int, name: str, address: str | None = None,
              **options) -> zmq.Socket:
        """Bind at address (default: _address); the handshake's port in use: a ListenError
        naming the flag."""
        pc, address = self.config.parallel_config, address or self._address(name)
        try:
            return make_zmq_socket(self.ctx, address, socket_type, bind=True, **options)
        except zmq.ZMQError as e:
            if self.num_engines > 1 and name == "handshake":
                raise listen_error(e, pc.data_parallel_address, pc.data_parallel_rpc_port + 1,
                                   "the engines' handshake", "--data-parallel-rpc-port",
                                   pc.data_parallel_rpc_port) from None
            raise RuntimeError(f"the frontend cannot listen on {address}: {e}") from None

    async def start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # The engine processes before any socket: a forked engine would hold the frontend's
        # listening sockets, their ports in use for as long as it lives.
        self._start_engine_processes()
        self.num_blocks = await self._launch_engines(self._bind_sockets(), deadline)
        self._take_first_input_frames(deadline)
        self.watchdog.start()
        logger.info("%d engine core(s) ready: KV blocks by engine %s", self.num_engines,
                    self.num_blocks)

    def attach(self, input_address: str, output_address: str, num_blocks: dict[int, int],
               timeout: float) -> None:
        """Instead of start, for one API server of several (minicore/entrypoints/
        multi_api_server.py): their launcher started the engines and gave them these addresses
        among the others'."""
        self._bind_sockets(input_address, output_address)
        self.num_blocks = num_blocks
        self._take_first_input_frames(time.monotonic() + timeout)
        self.watchdog.start()

    def _bind_sockets(self, input_address: str | None = None,
                      output_address: str | None = None) -> dict[str, list[str]]:
        """The engines' input ROUTER and output PULL; returns their addresses for the engines."""
        # Sync: sends never block (no high-water mark) and cost no future each.
        self.input_socket = self._bind(zmq.ROUTER, "input", input_address, rcvhwm=INPUT_RCVHWM,
                                       max_msg_size=INPUT_MAX_MSG_BYTES)
        # Sending to an engine that is gone raises instead of dropping the message silently.
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        output_socket = self._bind(zmq.PULL, "output", output_address)
        self.output_socket = zmq.asyncio.Socket.from_socket(output_socket)
        return {"inputs": [self.input_socket.getsockopt_string(zmq.LAST_ENDPOINT)],
                "outputs": [output_socket.getsockopt_string(zmq.LAST_ENDPOINT)]}

    async def _launch_engines(self, addresses: dict[str, list[str]],
                              deadline: float) -> dict[int, int]:
        """Answer every engine's handshake (remote ones too) with the addresses; returns each
        engine's KV blocks. The Ray backend starts its actors here (minicore/dp/ray_launch.py)."""
        handshake = zmq.asyncio.Socket.from_socket(self._bind(zmq.ROUTER, "handshake"))
        try:
            num_blocks = await wait_for_engine_startup(
                handshake, msgspec.msgpack.encode(addresses),
                self.config.parallel_config.engine_ranks, self.manager.procs, deadline,
                self._engine_exited)
            return {rank - self.first_rank: blocks for rank, blocks in num_blocks.items()}
        finally:
            handshake.close(linger=0)

    def _start_engine_processes(self) -> None:
        """This machine's engines, watched from the loop; the handshake they connect to is bound
        after (ZMQ connects in any order)."""
        self.manager = CoreEngineProcManager(self.config, self._address("handshake"))
        loop = asyncio.get_running_loop()
        for rank, proc in self.manager.procs.items():
            loop.add_reader(proc.sentinel, functools.partial(self._on_engine_exit, rank))

    def _take_first_input_frames(self, deadline: float) -> None:
        """Each engine's first frame on the input socket lets the ROUTER route to it. It was sent
        before the model load, so it is here by now (a blocking poll, as vLLM's)."""
        for _ in range(self.num_engines):
            timeout_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.input_socket.poll(timeout=timeout_ms):
                raise TimeoutError("an engine core's first input frame did not arrive")
            self.input_socket.recv_multipart()

    # ---- health --------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._dead_reason is not None

    @property
    def is_healthy(self) -> bool:
        return not self.errored and all(proc.is_alive() for proc in self.procs.values())

    @property
    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine core is dead: {self._dead_reason}")

    def _on_engine_exit(self, rank: int) -> None:
        proc = self.procs[rank]
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        # The sentinel turns readable as the process exits, a moment before it can be reaped.
        proc.join(1.0)
        reason = f"engine core {rank}'s process exited with code {proc.exitcode}"
        self.set_dead(reason)
        if not self._engine_exited.done():
            self._engine_exited.set_result(reason)

    def _ping(self, engine_index: int) -> None:
        """The watchdog's question to a quiet engine: its answer is a frame like any other, which
        no one awaits (no future under its call id)."""
        self._send(EngineCoreRequestType.UTILITY, (next(self._call_ids), "ping", ()),
                   engine_index, raise_if_dead=False)

    def _frames_pending(self) -> bool:
        return bool(self.output_socket.get(zmq.EVENTS) & zmq.POLLIN)

    def expect_engine_exit(self) -> None:
        """The server stops on a signal, which a terminal's Ctrl+C also sends to the engines (the
        process group): their exit is expected now, not an error; shutdown() stops the rest."""
        self._exit_expected = True

    def set_dead(self, reason: str) -> None:
        """Turn dead (once): stop the local engines, fail utility calls, tell on_dead."""
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        self.watchdog.stop()
        if not self._shutting_down and not self._exit_expected:
            logger.error("the engine core is dead: %s", reason)
            if self.manager is not None:
                self.manager.terminate()
        error = self.dead_error
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
        self._utility_calls.clear()
        if self.on_dead is not None:
            self.on_dead(error)

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> int:
        """Send a request to its engine; returns the engine's index."""
        self._send(EngineCoreRequestType.ADD, request)
        return 0

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in the engine (never raises: a dead engine has nothing to abort)."""
        self._send(EngineCoreRequestType.ABORT, request_ids, raise_if_dead=False)

    async def call_utility_async(self, method: str, *args, engine_index: int = 0) -> Any:
        """An engine utility method's result (minicore/engine/control.py); ValueError if the engine
        refused the call (its arguments, or its state), RuntimeError if it failed there."""
        if self.errored:
            raise self.dead_error
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        self._send(EngineCoreRequestType.UTILITY, (call_id, method, args), engine_index)
        return await future

    def resume_waves(self) -> None:
        """After a resume: one engine goes on by itself."""

    def _send(self, request_type: EngineCoreRequestType, payload, engine_index: int = 0,
              raise_if_dead: bool = True) -> None:
        if self.errored:
            if raise_if_dead:
                raise self.dead_error
            return
        try:
            self.input_socket.send_multipart(
                (self._identities[engine_index], request_type.value,
                 self._encoder.encode(payload)), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.set_dead(f"sending to it failed ({e})")
            if raise_if_dead:
                raise self.dead_error from e

    # ---- outputs -------------------------------------------------------------------------------

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next frame of outputs from any engine; raises EngineDeadError on ENGINE_CORE_DEAD.
        Utility results are settled here."""
        while True:
            frame = await self.output_socket.recv()
            if frame.startswith(ENGINE_CORE_DEAD):
                self._on_engine_dead_frame(frame)
                continue
            try:
                outputs = self._decoder.decode(frame)
            except msgspec.MsgspecError as e:
                self._drop(f"a malformed frame ({len(frame)} bytes: {e})")
                continue
            outputs.engine_index -= self.first_rank
            if not 0 <= outputs.engine_index < self.num_engines:
                self._drop(f"a frame from engine {outputs.engine_index + self.first_rank}, which "
                           "is not one of this frontend's")
                continue
            self._last_frame[outputs.engine_index] = time.monotonic()
            self._process_engine_outputs(outputs)
            return outputs

    def _on_engine_dead_frame(self, frame: bytes) -> None:
        engine_index = parse_engine_dead_frame(frame)
        if engine_index is None or not 0 <= engine_index - self.first_rank < self.num_engines:
            self._drop(f"an ENGINE_CORE_DEAD frame naming no engine of ours ({frame[:32]!r})")
        elif engine_index in self.procs:
            # Its process exits next, which the process watch sees: a forged notice does nothing.
            logger.error("engine core %d reports a fatal error", engine_index)
        else:
            self.set_dead(f"engine core {engine_index} reported a fatal error (ENGINE_CORE_DEAD)")
            raise self.dead_error

    def _drop(self, what: str) -> None:
        """Log a dropped frame: the first, then at every power of two, so a flood of them
        cannot flood the log."""
        self._num_dropped += 1
        if self._num_dropped & (self._num_dropped - 1) == 0:
            logger.error("dropped %s on the output socket (%d dropped so far)", what,
                         self._num_dropped)

    def _process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        if (result := outputs.utility_output) is None:
            return
        future = self._utility_calls.pop(result.call_id, None)
        if future is not None and not future.done():
            if result.failure_message is None:
                future.set_result(result.result)
            else:
                error = ValueError if result.caller_error else RuntimeError
                future.set_exception(error(result.failure_message))

    # ---- shutdown ------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop the local engines (SIGTERM, then SIGKILL after a timeout), fail what is still
        pending, close the sockets. Safe to call more than once."""
        if self._shutting_down:
            return
        self._shutting_down = True
        self.set_dead("the client was shut down")
        if self.manager is not None:
            loop = asyncio.get_running_loop()
            for proc in self.manager.procs.values():
                loop.remove_reader(proc.sentinel)
            await asyncio.to_thread(self.manager.close)
        if self.output_socket is not None:
            # Closing the asyncio socket first unregisters it from the event loop.
            self.output_socket.close(linger=0)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)
