"""EngineCoreProc: the engine core in its own process, serving a frontend over ZMQ.

Mirrors EngineCoreProc in vllm/v1/engine/core.py: the engine's side of the startup handshake
(described in minicore/engine/launch.py, which starts the process), process_input_sockets /
process_output_sockets, run_busy_loop and _send_engine_dead. Where vLLM runs two IO threads around
a blocking busy loop and hands messages over in queue.Queues, minicore runs one uvloop event loop
per engine process: the socket IO and the busy loop are coroutines joined by asyncio.Queues, and
only the model forward leaves the loop, for one worker thread. The loop steps while the scheduler
has requests (Scheduler.has_requests), polling every KV_POLL_INTERVAL_S when a step computes
nothing. With async scheduling a step is EngineCore.step_with_batch_queue's, awaited: the next
schedule runs on the loop while the forward thread runs the step before. Data parallelism is
DPEngineCoreProc's (minicore/dp/engine.py); UTILITY calls, ProcControl's
(minicore/engine/control.py); several frontends, ClientRouter's. Left out: preprocessing caches.
"""

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from minicore.engine.control import ProcControl
from minicore.engine.core import EngineCore
from minicore.engine.worker_rpc import decode_ext
from minicore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    engine_dead_frame,
)
from minicore.request import FinishReason, Request
from minicore.utils import freeze_gc_heap, make_zmq_socket

if TYPE_CHECKING:
    from minicore.config import EngineConfig
    from minicore.engine.components import EngineComponents

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 300.0
# How often the engine checks that the frontend that started it is still alive.
PARENT_CHECK_INTERVAL_S = 1.0
# Input-queue item types of the engine's own making (not on the wire).
_SHUTDOWN = "shutdown"
_IO_FAILED = "io_failed"
_UNDECODABLE_ADD = "undecodable_add"
# With KV transfers in flight and nothing to compute, how long the loop waits for input before it
# steps again to poll them (vLLM spins; a short wait spares a shared CPU).
KV_POLL_INTERVAL_S = 0.005


class EngineCoreProc(ProcControl, EngineCore):
    """An EngineCore behind sockets. Built synchronously (handshake and model load, before any
    event loop); run() then serves on the running loop."""

    def __init__(self, config: "EngineConfig",
                 build_components: "Callable[[EngineConfig], EngineComponents]",
                 handshake_address: str, engine_index: int = 0,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S):
        """build_components: the composition root's (minicore/engine/components.py), called once
        the handshake is under way and the DP group joined."""
        self.engine_index = engine_index
        self.parent_pid = os.getppid()
        self.shutdown_requested = False
        identity = engine_index.to_bytes(2, "little")
        self.ctx = zmq.Context()
        with self._perform_handshakes(handshake_address, identity, handshake_timeout) as addresses:
            # A DEALER and a PUSH per frontend (several API servers: vLLM's client_count);
            # outputs linger, so that ENGINE_CORE_DEAD still leaves when the process exits.
            self._input_sockets = [make_zmq_socket(self.ctx, address, zmq.DEALER, bind=False,
                                                   identity=identity)
                                   for address in addresses["inputs"]]
            self._output_sockets = [make_zmq_socket(self.ctx, address, zmq.PUSH, bind=False,
                                                    linger=4000)
                                    for address in addresses["outputs"]]
            for socket in self._input_sockets:  # a ROUTER routes only to peers it has heard
                socket.send(b"")
            config.parallel_config.client_count = len(self._output_sockets)
            self._init_data_parallel(config)
            components = build_components(config)
            self.client_router = components.client_router
            super().__init__(config, components)
            freeze_gc_heap()
        self._decoders = {
            EngineCoreRequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
            EngineCoreRequestType.UTILITY: msgspec.msgpack.Decoder(tuple[int, str, list],
                                                                   ext_hook=decode_ext),
            EngineCoreRequestType.START_DP_WAVE: msgspec.msgpack.Decoder(tuple[int, int]),
        }
        self._last_stats = None
        self.num_received_requests = 0
        # Bound once, as EngineCore.step_fn: one step at a time, or two with the batch queue.
        if self.batch_queue.size > 1:
            self._process_engine_step = self._process_batch_queue_step

    def _init_data_parallel(self, config: "EngineConfig") -> None:
        """Join the DP group before the model loads (DPEngineCoreProc); nothing to do alone."""

    @contextlib.contextmanager
    def _perform_handshakes(self, address: str, identity: bytes, timeout: float):
        """HELLO, then yield the frontend's addresses; READY once the body (the model load) is
        done. A Ray actor is handed its addresses instead (minicore/dp/ray_launch.py)."""
        handshake = make_zmq_socket(self.ctx, address, zmq.DEALER, bind=False,
                                    identity=identity, linger=5000)
        try:
            handshake.send(msgspec.msgpack.encode({"status": "HELLO",
                                                   "engine_index": self.engine_index}))
            if not handshake.poll(timeout=int(timeout * 1000)):
                raise RuntimeError(f"the frontend did not answer this engine's HELLO within "
                                   f"{timeout:g} s (handshake socket {address})")
            try:
                yield msgspec.msgpack.decode(handshake.recv(), type=dict[str, list[str]])
            except Exception as e:  # to the frontend at once: a headless rank's it cannot see
                error = f"{type(e).__name__}: {e}"
                handshake.send(msgspec.msgpack.encode({"status": "FAILED", "error": error}))
                self.ctx.destroy(linger=5000)  # sent before exit: a forked engine skips teardown
                raise
            handshake.send(msgspec.msgpack.encode(
                {"status": "READY", "engine_index": self.engine_index,
                 "num_gpu_blocks": self.config.cache_config.num_blocks}))
        finally:
            handshake.close()

    # ---- the event loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until shutdown is requested; a fatal error sends ENGINE_CORE_DEAD and raises."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_shutdown)
        self.input_queue: asyncio.Queue[tuple[Any, Any]] = asyncio.Queue()
        self.output_queue: asyncio.Queue[EngineCoreOutputs | bytes] = asyncio.Queue()
        self.input_sockets = list(map(zmq.asyncio.Socket.from_socket, self._input_sockets))
        self.output_sockets = list(map(zmq.asyncio.Socket.from_socket, self._output_sockets))
        input_task = asyncio.create_task(self.process_input_sockets())
        self.output_task = asyncio.create_task(self.process_output_sockets())
        for task in (input_task, self.output_task):
            task.add_done_callback(self._on_io_task_done)
        loop.call_later(PARENT_CHECK_INTERVAL_S, self._check_parent)
        logger.info("EngineCore %d ready: %d KV blocks", self.engine_index,
                    self.config.cache_config.num_blocks)
        try:
            await self.run_busy_loop()
        except Exception:
            logger.exception("EngineCore encountered a fatal error.")
            await self._send_engine_dead()
            raise
        finally:
            input_task.cancel()
            self.output_task.cancel()
            self.executor.shutdown(wait=False, cancel_futures=True)

    def _request_shutdown(self) -> None:
        if not self.shutdown_requested:
            logger.info("EngineCore %d: shutdown requested.", self.engine_index)
            self.shutdown_requested = True
            # Wake the busy loop if it is waiting for input.
            self.input_queue.put_nowait((_SHUTDOWN, None))

    def _check_parent(self) -> None:
        """A frontend killed without a chance to stop its engines leaves them orphaned: stop."""
        if os.getppid() != self.parent_pid:
            logger.warning("EngineCore %d: the frontend process is gone; shutting down.",
                           self.engine_index)
            self._request_shutdown()
        else:
            asyncio.get_running_loop().call_later(PARENT_CHECK_INTERVAL_S, self._check_parent)

    def _on_io_task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            # The busy loop raises it, which makes it fatal.
            self.input_queue.put_nowait((_IO_FAILED, task.exception()))

    def close(self, fatal: bool) -> None:
        """Close the sockets (the output socket lingers after a fatal error so that
        ENGINE_CORE_DEAD is delivered)."""
        self.shutdown()
        for input_socket, output_socket in zip(self._input_sockets, self._output_sockets):
            input_socket.close(linger=0)
            output_socket.close(linger=4000 if fatal else 0)
        self.ctx.term()

    # ---- socket IO -----------------------------------------------------------------------------

    async def process_input_sockets(self) -> None:
        """Decode each frontend's messages onto the input queue; drop (and log) malformed ones."""
        await asyncio.gather(*map(self._read_frontend, range(len(self.input_sockets))))

    async def _read_frontend(self, client: int) -> None:
        while True:
            self._enqueue(client, await self.input_sockets[client].recv_multipart())
            # Take what else has arrived without an asyncio future per message (a burst of
            # requests costs a third less this way).
            while True:
                try:
                    frames = self._input_sockets[client].recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._enqueue(client, frames)

    def _enqueue(self, client: int, frames: list[bytes]) -> None:
        try:
            item = self.client_router.on_input(client, *self._decode_request(frames))
            self.input_queue.put_nowait(item)
        except (ValueError, msgspec.MsgspecError) as e:
            if (header := _add_request_header(frames)) is not None:
                # Refuse it by name, or its sender would wait for it forever.
                self.client_router.on_add(client, header[0])
                self.input_queue.put_nowait((_UNDECODABLE_ADD, (*header, str(e))))
                return
            logger.error("EngineCore %d dropped a malformed message (%d frames, %d bytes): %s",
                         self.engine_index, len(frames), sum(map(len, frames)), e)

    def _decode_request(self, frames: list[bytes]) -> tuple[EngineCoreRequestType, Any]:
        if len(frames) != 2:
            raise ValueError(f"expected [type, payload], got {len(frames)} frames")
        request_type = EngineCoreRequestType(frames[0])
        return request_type, self._decoders[request_type].decode(frames[1])

    async def process_output_sockets(self) -> None:
        """Encode and send what the busy loop queues; stops after sending ENGINE_CORE_DEAD."""
        encoder = msgspec.msgpack.Encoder()
        while True:
            outputs = await self.output_queue.get()
            if outputs == ENGINE_CORE_DEAD:
                for output_socket in self.output_sockets:
                    await output_socket.send(engine_dead_frame(self.engine_index))
                return
            for client, frame in self.client_router.route(outputs):
                await self.output_sockets[client].send(encoder.encode(frame))

    async def _send_engine_dead(self) -> None:
        """Queue ENGINE_CORE_DEAD behind any pending outputs and wait (bounded) until it is sent."""
        self.output_queue.put_nowait(ENGINE_CORE_DEAD)
        try:
            await asyncio.wait_for(asyncio.shield(self.output_task), timeout=5.0)
        except (TimeoutError, zmq.ZMQError, asyncio.CancelledError):
            logger.critical("EngineCore %d could not send ENGINE_CORE_DEAD.", self.engine_index)

    def _send(self, outputs: list[EngineCoreOutput] | None = None, **fields) -> None:
        """Queue outputs (and other EngineCoreOutputs fields) for the frontend, always with the
        current stats: every frame tells the frontend the state the engine was in when it made
        it, and the frontend balances load on those counts."""
        stats = self._last_stats = self.scheduler.make_stats()
        self.output_queue.put_nowait(EngineCoreOutputs(
            self.engine_index, outputs or [], stats, time.monotonic(),
            num_received_requests=self.num_received_requests, **fields))

    def _publish_stats_if_changed(self) -> None:
        if self.scheduler.make_stats() != self._last_stats:
            self._send()

    # ---- the busy loop -------------------------------------------------------------------------

    async def run_busy_loop(self) -> None:
        """Until shutdown: wait for work without spinning, take every pending input, step."""
        must_wait = True
        while not self.shutdown_requested:
            await self._process_input_queue(must_wait)
            if self.shutdown_requested:
                return
            # A step that scheduled nothing cannot be followed by one that does until an input
            # changes something: wait for one instead of spinning.
            must_wait = not await self._process_engine_step()

    def has_work(self) -> bool:
        """Steps to take: the scheduler's requests, or steps in flight to update from."""
        return self.scheduler.has_requests() or self.batch_queue.has_pending()

    async def _process_input_queue(self, must_wait: bool) -> None:
        while must_wait or not self.has_work():
            if self.shutdown_requested:
                return
            if not await self._wait_for_input():
                break
            must_wait = False
        self._drain_input_queue()

    async def _wait_for_input(self) -> bool:
        """Handle the next input, waiting for it; while the scheduler has requests but nothing
        to compute (a KV connector's transfers), at most KV_POLL_INTERVAL_S. False if none came."""
        # Inputs handled while idle (an abort, say) change the stats no step will send.
        self._publish_stats_if_changed()
        if self.has_work():
            try:
                item = await asyncio.wait_for(self.input_queue.get(), KV_POLL_INTERVAL_S)
            except asyncio.TimeoutError:  # noqa: UP041 (a distinct class before 3.11)
                return False
        else:
            self._notify_idle()  # what waits for an idle engine (a pause, a sleep) goes on
            item = await self.input_queue.get()
        self._handle_client_request(*item)
        return True

    def _drain_input_queue(self) -> None:
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())

    async def _process_engine_step(self) -> bool:
        """EngineCore.step with the forward in the worker thread; True if the model ran."""
        if not self.scheduler.has_requests():
            return False
        scheduler_output = self.scheduler.schedule()
        model_output = await self._run_forward(self.execute_model, scheduler_output)
        # Inputs that arrived during the forward wait for the next iteration, as in vLLM: an
        # ABORT X then ADD X applied here would hand the old X's token to the new X.
        self._send(self.update_from_output(scheduler_output, model_output))
        return scheduler_output.total_num_scheduled_tokens > 0

    async def _process_batch_queue_step(self) -> bool:
        """EngineCore.step_with_batch_queue with the wait awaited; True if the new step runs the
        model. A step that scheduled nothing before a step that ran was updated is followed by
        one more schedule: that update may have freed what it lacked, and the busy loop would
        otherwise wait for input."""
        while True:
            executed = self._submit_next_batch()
            if (batch := self.batch_queue.take_finished(executed)) is None:
                return executed
            future, scheduler_output = batch
            model_output = await asyncio.wrap_future(future)
            self._send(self.update_from_output(scheduler_output, model_output))
            if executed or scheduler_output.total_num_scheduled_tokens == 0:
                return executed

    async def _run_forward(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _handle_client_request(self, request_type, request: Any) -> None:
        if request_type is EngineCoreRequestType.ADD:
            self._add_request(request)
        elif request_type is EngineCoreRequestType.ABORT:
            self.abort_requests(request)
        elif request_type is EngineCoreRequestType.UTILITY:
            self._call_utility(*request)
        elif request_type is EngineCoreRequestType.START_DP_WAVE:
            logger.warning("EngineCore %d ignored START_DP_WAVE: not a data-parallel engine.",
                           self.engine_index)
        elif request_type == _UNDECODABLE_ADD:
            request_id, current_wave, message = request
            self._on_request_arrived(current_wave)
            self._reject(request_id, message)
        elif request_type == _IO_FAILED:
            raise RuntimeError("an engine socket task failed") from request

    def _add_request(self, request: EngineCoreRequest) -> None:
        self._on_request_arrived(request.current_wave)
        try:
            self.add_request(Request.from_engine_core_request(request))
        except ValueError as e:
            self._reject(request.request_id, str(e))

    def _on_request_arrived(self, current_wave: int) -> None:
        """Every ADD, run or refused (DPEngineCoreProc also wakes its wave here)."""
        self.num_received_requests += 1

    def _reject(self, request_id: str, message: str) -> None:
        """Finish a request the engine cannot run, alone, with an error, so that the frontend
        neither waits for it forever nor lets it reach a batch."""
        logger.error("EngineCore %d rejected request %r: %s", self.engine_index, request_id,
                     message)
        self._send([EngineCoreOutput(request_id, [], FinishReason.ERROR,
                                     error_message=message)])


def _add_request_header(frames: list[bytes]) -> tuple[str, int] | None:
    """(request_id, current_wave) of an ADD whose payload does not decode as an
    EngineCoreRequest, read from the raw msgpack array; None if even those are unreadable."""
    if len(frames) != 2 or frames[0] != EngineCoreRequestType.ADD.value:
        return None
    try:
        fields = msgspec.msgpack.decode(frames[1])
    except msgspec.MsgspecError:
        return None
    if not isinstance(fields, list) or not fields or not isinstance(fields[0], str):
        return None
    wave = fields[8] if len(fields) > 8 and type(fields[8]) is int else 0
    return fields[0], wave
