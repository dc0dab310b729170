"""AsyncEngineClient: the frontend's side of the engine processes, on the frontend's event loop.

Mirrors AsyncLLM (vllm/v1/engine/async_llm.py) with the parts of AsyncMPClient and
DPLBAsyncMPClient (vllm/v1/engine/core_client.py) and the output handling of
vllm/v1/engine/output_processor.py that minicore needs: it starts the engine processes (one, or one
per local DP rank) and does the startup handshake with each (ranks on other machines connect to
it), sends requests on a ROUTER socket and reads outputs from a PULL socket (msgspec msgpack),
keeps a RequestState per request (detokenizing, stop strings, timestamps), and streams
RequestOutputs to each request's consumer. With data parallelism a DPCoordinator (minicore/dp)
picks each request's engine and keeps the engines' waves going. It watches the engine processes:
when one dies (or sends ENGINE_CORE_DEAD) every in-flight request fails at once with
EngineDeadError, the client turns unhealthy, and it stops its other engines (DP ranks cannot go on
without a peer).

Streams are cumulative (each RequestOutput has all text and token ids so far) and, as vLLM's
RequestOutputCollector, coalescing: a consumer that falls behind gets the newest state, not a
backlog. Left out: several frontends, logprobs, n > 1, LoRA.
"""

import asyncio
import functools
import itertools
import logging
import multiprocessing
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from minicore.config import EngineConfig
from minicore.dp.coordinator import DPCoordinator
from minicore.engine.core_proc import freeze_gc_heap, make_zmq_socket, start_engine_processes
from minicore.engine.output_processor import RequestState
from minicore.model.loader import load_tokenizer, resolve_model_dir
from minicore.outputs import RequestOutput
from minicore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    SchedulerStats,
)
from minicore.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SHUTDOWN_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine process died: in-flight and later requests fail with this."""


class RequestStream:
    """One request's one-slot queue (vLLM's RequestOutputCollector): the engine side marks it
    ready after each output; the consumer takes the newest state, or the error that ended it."""

    __slots__ = ("error", "ready", "state")

    def __init__(self, state: RequestState):
        self.state = state
        self.ready = asyncio.Event()
        self.error: BaseException | None = None

    def notify(self) -> None:
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        self.ready.clear()
        if self.error is not None:
            raise self.error
        return self.state.make_request_output()


class AsyncEngineClient:
    """Use `await AsyncEngineClient.create(config)`, and `await client.shutdown()` at the end.

    Hooks for metrics (plain attributes, None by default), called on the event loop:
      on_new_tokens(state, num_new_tokens, interval_s): after each engine output that brought
        tokens; interval_s is the time since the request's previous output, None for its first
        (then the time to first token is state.first_token_time - state.arrival_time).
      on_request_finished(state): once per request that finished (state.finish_reason "stop",
        "length" or "abort"), including aborts; not for requests failed by a dead engine.
    """

    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, model_name: str):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.num_engines = config.parallel_config.data_parallel_size
        self.coordinator = DPCoordinator(self.num_engines) if self.num_engines > 1 else None
        # RequestState of every in-flight request, by request id.
        self.states: dict[str, RequestState] = {}
        # The newest scheduler stats of each engine, by engine index.
        self.latest_stats: dict[int, SchedulerStats] = {}
        self.on_new_tokens: Callable[[RequestState, int, float | None], None] | None = None
        self.on_request_finished: Callable[[RequestState], None] | None = None
        self._streams: dict[str, RequestStream] = {}
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._identities = [i.to_bytes(2, "little") for i in range(self.num_engines)]
        self._dead_reason: str | None = None
        self._shutting_down = False
        self._tmpdir = tempfile.mkdtemp(prefix="minicore-")
        self.ctx = zmq.Context()
        # This machine's engine processes, by DP rank (ranks on other machines have none here).
        self.procs: dict[int, multiprocessing.Process] = {}
        # Set when the first of them exits.
        self._engine_exited = asyncio.get_running_loop().create_future()
        self._output_task: asyncio.Task | None = None

    # ---- startup -------------------------------------------------------------------------------

    @classmethod
    async def create(cls, config: EngineConfig, *, startup_timeout: float = 300.0,
                     model_name: str | None = None) -> "AsyncEngineClient":
        """Resolve the model (a GGUF is converted once to a cached safetensors directory, so the
        frontend and the engines read the same files), load the tokenizer, start the engines and
        wait for every one (local or not) to be READY. Sets config.model_config.model to the
        resolved directory and config.cache_config.num_blocks to the smallest engine's KV blocks."""
        name = model_name or config.model_config.model or DEFAULT_MODEL_NAME
        model_dir = await asyncio.to_thread(resolve_model_dir, config.model_config.model)
        config.model_config.model = str(model_dir)
        tokenizer, vocab_size = await asyncio.to_thread(load_tokenizer, model_dir)
        client = cls(config, tokenizer, vocab_size, name)
        try:
            await client._start_engines(startup_timeout)
        except BaseException:
            await client.shutdown()
            raise
        # The frontend's startup heap is static too (torch, transformers, the tokenizer).
        freeze_gc_heap()
        return client

    def _bind(self, socket_type: int, name: str) -> zmq.Socket:
        """Bind a frontend socket: ipc for one engine; tcp with data parallelism, so that ranks on
        other machines can connect (the handshake at rpc_port + 1, the others on free ports)."""
        pc = self.config.parallel_config
        if self.num_engines == 1:
            address = f"ipc://{self._tmpdir}/{name}"
        elif name == "handshake":
            address = f"tcp://{pc.data_parallel_address}:{pc.data_parallel_rpc_port + 1}"
        else:
            address = f"tcp://{pc.data_parallel_address}:*"
        try:
            return make_zmq_socket(self.ctx, address, socket_type, bind=True)
        except zmq.ZMQError as e:
            raise RuntimeError(f"the frontend cannot listen on {address}: {e}") from None

    async def _start_engines(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # Requests go out on input_socket (sync: sends never block, HWM is unlimited) and
        # outputs come in on output_socket.
        self.input_socket = self._bind(zmq.ROUTER, "input")
        # Sending to an engine that is gone raises instead of dropping the message silently.
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        output_socket = self._bind(zmq.PULL, "output")
        self.output_socket = zmq.asyncio.Socket.from_socket(output_socket)
        handshake = zmq.asyncio.Socket.from_socket(self._bind(zmq.ROUTER, "handshake"))
        addresses = msgspec.msgpack.encode({
            "input": self.input_socket.getsockopt_string(zmq.LAST_ENDPOINT),
            "output": output_socket.getsockopt_string(zmq.LAST_ENDPOINT)})
        try:
            self.procs = start_engine_processes(
                self.config, handshake.getsockopt_string(zmq.LAST_ENDPOINT))
            for rank, proc in self.procs.items():
                loop.add_reader(proc.sentinel, functools.partial(self._on_engine_exit, rank))
            num_blocks = await self._handshake(handshake, addresses, deadline)
            # Each engine's first frame on the input socket, which lets the ROUTER route to it.
            # It was sent before the model load, so it is here by now (a blocking poll, as vLLM's).
            for _ in range(self.num_engines):
                if not self.input_socket.poll(timeout=max(0, int((deadline - loop.time()) * 1000))):
                    raise TimeoutError("an engine core's first input frame did not arrive")
                self.input_socket.recv_multipart()
        finally:
            handshake.close(linger=0)
        self.config.cache_config.num_blocks = min(num_blocks.values())
        self._output_task = asyncio.create_task(self._process_outputs())
        self._output_task.add_done_callback(self._on_output_task_done)
        logger.info("%d engine core(s) ready: KV blocks by engine %s", self.num_engines, num_blocks)

    async def _handshake(self, handshake: zmq.asyncio.Socket, addresses: bytes,
                         deadline: float) -> dict[int, int]:
        """HELLO, then READY, from every engine, in any order: answer each HELLO with the
        addresses to connect to. Returns each engine's number of KV blocks."""
        engines = set(range(self.num_engines))
        waiting_hello, num_blocks = set(engines), {}
        while len(num_blocks) < self.num_engines:
            what = (f"HELLO from engine(s) {sorted(waiting_hello)}" if waiting_hello
                    else f"READY from engine(s) {sorted(engines - set(num_blocks))}")
            identity, frame = await self._startup_wait(handshake.recv_multipart(), deadline, what)
            message, index = msgspec.msgpack.decode(frame), int.from_bytes(identity, "little")
            status = message.get("status") if isinstance(message, dict) else None
            if status == "HELLO" and index in waiting_hello:
                waiting_hello.remove(index)
                await handshake.send_multipart([identity, addresses])
            elif status == "READY" and index < self.num_engines and index not in waiting_hello:
                num_blocks[index] = message["num_gpu_blocks"]
            else:
                raise RuntimeError(f"engine handshake: unexpected {message!r} from engine {index} "
                                   f"(a DP rank started twice, or outside the data parallel size "
                                   f"{self.num_engines}?)")
        return num_blocks

    async def _startup_wait(self, recv: asyncio.Future, deadline: float, what: str):
        loop = asyncio.get_running_loop()
        done, _ = await asyncio.wait({recv, self._engine_exited},
                                     timeout=max(0.0, deadline - loop.time()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if recv in done:
            return recv.result()
        recv.cancel()
        if self._engine_exited.done():
            raise RuntimeError(f"{self._dead_reason} during startup, while waiting for {what}; "
                               "see its log above")
        remote = sorted(set(range(self.num_engines)) - set(self.procs))
        hint = (f" (ranks {remote} are not started here: start them with --headless)"
                if remote else "")
        raise TimeoutError(f"no {what} within the startup timeout{hint}")

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
        self._set_dead(f"engine core {rank}'s process exited with code {proc.exitcode}")
        if not self._engine_exited.done():
            self._engine_exited.set_result(rank)

    def _on_output_task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            # Nothing would deliver outputs any more: as good as a dead engine.
            logger.error("the output handler failed", exc_info=error)
            self._set_dead(f"the frontend's output handler failed ({error!r})")

    def _set_dead(self, reason: str) -> None:
        """Fail every in-flight request and utility call at once; later calls fail too."""
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        if not self._shutting_down:
            logger.error("the engine core is dead: %s; failing %d in-flight requests", reason,
                         len(self._streams))
            # DP ranks cannot go on without a peer: stop them rather than leave them waiting.
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.terminate()
        error = self.dead_error
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        self.states.clear()
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
        self._utility_calls.clear()

    # ---- requests ------------------------------------------------------------------------------

    async def generate(self, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, request_id: str, *, priority: int = 0,
                       data_parallel_rank: int | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's cumulative RequestOutputs, the last with finished=True.
        data_parallel_rank: the engine to run it on (default: the least loaded).

        Raises ValueError (at the first iteration, before anything is sent) for an invalid
        request, EngineDeadError if the engine is or becomes dead. A request left unfinished is
        aborted in the engine when the iterator is closed: at once if the consumer closes it
        (contextlib.aclosing, as a server should: a client that disconnects cancels the consumer
        wherever it awaits) or is cancelled while it waits here for an output; else only once
        the iterator is garbage collected.
        """
        if self.errored:
            raise self.dead_error
        self._validate(prompt_token_ids, params, request_id, data_parallel_rank)
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, self.tokenizer)
        stream = RequestStream(state)
        self.states[request_id] = state
        self._streams[request_id] = stream
        self._add_request(EngineCoreRequest(
            request_id, state.prompt_token_ids, params, self.tokenizer.eos_token_id,
            state.arrival_time, priority, data_parallel_rank=data_parallel_rank), state)
        try:
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                self._abort(request_id, notify=False)

    def _add_request(self, request: EngineCoreRequest, state: RequestState) -> None:
        if self.coordinator is None:
            self._send(EngineCoreRequestType.ADD, request)
            return
        state.engine_index = self.coordinator.select_engine(request.data_parallel_rank)
        request.current_wave = self.coordinator.current_wave
        self._send(EngineCoreRequestType.ADD, request, state.engine_index)
        if (start := self.coordinator.on_request_sent(state.engine_index)) is not None:
            self._start_wave(*start)

    def _start_wave(self, wave: int, exclude_engine_index: int) -> None:
        """Wake the engines for a wave (the one given the request that starts it wakes itself)."""
        for engine_index in range(self.num_engines):
            if engine_index != exclude_engine_index:
                self._send(EngineCoreRequestType.START_DP_WAVE, (wave, exclude_engine_index),
                           engine_index)

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                  data_parallel_rank: int | None) -> None:
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < self.num_engines:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is out of range: there "
                             f"are {self.num_engines} data parallel engines")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        max_model_len = self.config.scheduler_config.max_model_len
        if len(prompt_token_ids) > max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, more than "
                             f"max_model_len ({max_model_len})")
        # The engine would drop a request whose ids do not decode as ints: check here, not hang.
        if (not all(type(t) is int for t in prompt_token_ids)
                or min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")

    async def abort(self, request_id: str) -> None:
        """Abort a request: the engine frees it, and its stream ends with finish_reason "abort".
        Unknown or finished requests are ignored."""
        if request_id in self._streams:
            self._abort(request_id, notify=True)

    def _abort(self, request_id: str, notify: bool) -> None:
        state = self.states.pop(request_id)
        stream = self._streams.pop(request_id)
        if not self.errored:
            self._send(EngineCoreRequestType.ABORT, [request_id], state.engine_index,
                       raise_if_dead=False)
        state.finish_reason = "abort"
        if notify:
            stream.notify()
        if self.on_request_finished is not None:
            self.on_request_finished(state)

    async def call_utility(self, method: str, *args, engine_index: int = 0) -> Any:
        """Call an engine utility ("get_stats", "reset_prefix_cache", "ping") on one engine and
        return its result; RuntimeError if it failed in the engine."""
        if self.errored:
            raise self.dead_error
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        self._send(EngineCoreRequestType.UTILITY, (call_id, method, args), engine_index)
        return await future

    def _send(self, request_type: EngineCoreRequestType, payload, engine_index: int = 0,
              raise_if_dead: bool = True):
        try:
            self.input_socket.send_multipart(
                (self._identities[engine_index], request_type.value,
                 self._encoder.encode(payload)), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._set_dead(f"sending to it failed ({e})")
            if raise_if_dead:
                raise self.dead_error from e

    # ---- outputs -------------------------------------------------------------------------------

    async def _process_outputs(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        while True:
            frame = await self.output_socket.recv()
            if frame == ENGINE_CORE_DEAD:
                self._set_dead("an engine core reported a fatal error (ENGINE_CORE_DEAD)")
                return
            try:
                outputs = decoder.decode(frame)
            except msgspec.MsgspecError as e:
                logger.error("dropped a malformed frame from engine core %d (%d bytes): %s",
                             self.engine_index, len(frame), e)
                continue
            self._handle_outputs(outputs)
            # A recv of a frame already queued completes without yielding: let the consumers
            # take this output before the next, or an engine that runs ahead starves them.
            await asyncio.sleep(0)

    def _handle_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.latest_stats[outputs.engine_index] = outputs.scheduler_stats
        if self.coordinator is not None and (start := self.coordinator.on_outputs(outputs)):
            self._start_wave(*start)
        if (result := outputs.utility_output) is not None:
            future = self._utility_calls.pop(result.call_id, None)
            if future is not None and not future.done():
                if result.failure_message is None:
                    future.set_result(result.result)
                else:
                    future.set_exception(RuntimeError(result.failure_message))
        states, streams = self.states, self._streams
        for output in outputs.outputs:
            if (state := states.get(output.request_id)) is None:
                continue  # aborted here while the engine was producing it
            previous_token_time = state.last_token_time
            if state.process(output):
                # A stop string ended it: the engine does not know, so abort it there.
                self._send(EngineCoreRequestType.ABORT, [output.request_id], state.engine_index,
                           raise_if_dead=False)
            if self.on_new_tokens is not None and output.new_token_ids:
                interval = (None if previous_token_time is None
                            else state.last_token_time - previous_token_time)
                self.on_new_tokens(state, len(output.new_token_ids), interval)
            streams[output.request_id].notify()
            if state.finished:
                del states[output.request_id], streams[output.request_id]
                if self.on_request_finished is not None:
                    self.on_request_finished(state)

    # ---- shutdown ------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop the local engines (SIGTERM, then SIGKILL after a timeout), fail what is still in
        flight, close the sockets. Safe to call more than once."""
        if self._shutting_down:
            return
        self._shutting_down = True
        self._set_dead("the client was shut down")
        if self._output_task is not None:
            self._output_task.cancel()
        await self._stop_engine_processes()
        if self._output_task is not None:
            # Closing the asyncio socket first unregisters it from the event loop.
            self.output_socket.close(linger=0)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    async def _stop_engine_processes(self) -> None:
        loop = asyncio.get_running_loop()
        for proc in self.procs.values():
            loop.remove_reader(proc.sentinel)
            if proc.is_alive():
                proc.terminate()
        deadline = loop.time() + SHUTDOWN_TIMEOUT_S
        for rank, proc in self.procs.items():
            await asyncio.to_thread(proc.join, max(0.0, deadline - loop.time()))
            if proc.is_alive():
                logger.warning("engine core %d did not stop within %g s: killing it", rank,
                               SHUTDOWN_TIMEOUT_S)
                proc.kill()
                await asyncio.to_thread(proc.join, SHUTDOWN_TIMEOUT_S)
