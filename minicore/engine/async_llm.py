"""AsyncLLM: generate and abort on the frontend's event loop, over engine processes.

Mirrors vllm/v1/engine/async_llm.py: requests go through the InputProcessor (checked and turned
into EngineCoreRequests), out through the engine core client (minicore/engine/core_client.py), and
their outputs come back through one output handler task into the OutputProcessor, which feeds each
request's stream. The server (minicore/entrypoints/) and the benchmarks drive it.

Streams are cumulative (each RequestOutput has all text and token ids so far) and coalescing: a
consumer that falls behind gets the newest state, not a backlog. When the engine dies, every
stream in flight ends with EngineDeadError at once. The control plane (vLLM's AsyncLLM.sleep,
wake_up, pause_generation, resume_generation, collective_rpc, the weight update) calls every
engine's utility method (minicore/engine/control.py) and returns when all are done; while the
engines are paused or asleep, new requests wait here, before any engine sees them (so no DP wave
starts), and go on at resume. With --otlp-traces-endpoint each request ends in an OpenTelemetry
span (minicore/tracing/otel.py), the child of the trace context generate was given. Left out:
logprobs, n > 1 fan-out (the server makes one request per choice), LoRA, pooling.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from minicore.config import EngineConfig
from minicore.dp.client import engine_client_class
from minicore.engine.control import PauseMode, check_pause_mode, check_sleep_level, wake_tags
from minicore.engine.core_client import EngineDeadError, make_async_mp_client
from minicore.engine.input_processor import InputProcessor, Prompt
from minicore.engine.launch import resolve_model
from minicore.engine.output_processor import OutputProcessor, RequestOutputCollector
from minicore.outputs import RequestOutput
from minicore.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from minicore.sampling_params import SamplingParams
from minicore.tracing.otel import make_request_tracer
from minicore.utils import freeze_gc_heap

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# vLLM's /scale_elastic_ep default: how long a scale down waits for the leaving ranks' requests.
DEFAULT_DRAIN_TIMEOUT_S = 120


class AsyncLLM:
    """Use `await AsyncLLM.from_engine_config(config)`, and `await llm.shutdown()` at the end."""

    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, model_name: str,
                 engine_core):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.num_engines = len(config.parallel_config.engine_ranks)
        self.input_processor = InputProcessor(config, tokenizer, vocab_size)
        self.output_processor = OutputProcessor(tokenizer, make_request_tracer(
            config.observability_config.otlp_traces_endpoint))
        self.engine_core = engine_core
        engine_core.on_dead = self.output_processor.fail_all
        # Set while the engines take requests; new ones wait for it (pause, sleep).
        self._resumed = asyncio.Event()
        self._resumed.set()
        # Called with every engine's sleep level (0: awake) after sleep and wake_up (metrics).
        self.on_sleep_state: Callable[[list[int]], None] | None = None
        # The newest scheduler stats of each engine, by engine index.
        self.latest_stats: dict[int, SchedulerStats] = {}
        self.is_scaling_elastic_ep = False
        self.output_handler = asyncio.create_task(self._run_output_handler())
        self.output_handler.add_done_callback(self._on_output_handler_done)

    @classmethod
    async def from_engine_config(cls, config: EngineConfig, *, startup_timeout: float = 300.0,
                                 model_name: str | None = None) -> "AsyncLLM":
        """Resolve the model (a GGUF is converted once to a cached safetensors directory, so the
        frontend and the engines read the same files), load the tokenizer, start the engines and
        wait for every one (local or not) to be READY."""
        from minicore.model.loader import load_tokenizer

        name = model_name or config.model_config.model or DEFAULT_MODEL_NAME
        config = await asyncio.to_thread(resolve_model, config)
        mc = config.model_config
        tokenizer, vocab_size = await asyncio.to_thread(load_tokenizer, mc.model, mc.tokenizer)
        client_cls = engine_client_class(config)
        # Imported only here: Ray is an optional extra (minicore[ray]).
        if config.parallel_config.enable_elastic_ep:
            from minicore.dp.ray_elastic import ElasticRayDPLBAsyncMPClient as client_cls
        elif config.parallel_config.data_parallel_backend == "ray":
            from minicore.dp.ray_launch import RayDPLBAsyncMPClient as client_cls
        engine_core = await make_async_mp_client(config, startup_timeout, client_cls)
        # The frontend's startup heap is static too (transformers, the tokenizer).
        freeze_gc_heap()
        return cls(config, tokenizer, vocab_size, name, engine_core)

    # ---- health --------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self.engine_core.errored

    @property
    def is_healthy(self) -> bool:
        return self.engine_core.is_healthy

    @property
    def num_blocks(self) -> int:
        """KV cache blocks of the smallest engine."""
        return min(self.engine_core.num_blocks.values())

    # ---- requests ------------------------------------------------------------------------------

    async def generate(self, prompt: Prompt | EngineCoreRequest,
                       sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       data_parallel_rank: int | None = None, prompt_text: str | None = None,
                       trace_headers: Mapping[str, str] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream the request's cumulative RequestOutputs, the last with finished=True.

        prompt: a string, a list of token ids, or an EngineCoreRequest that the InputProcessor
        already built (then prompt_text is the text it came from, if any, and the other arguments
        are not used). data_parallel_rank: the engine to run it on (default: the least loaded).
        trace_headers: the client's W3C trace context (traceparent, tracestate), the parent of
        the request's span.
        Raises ValueError (at the first iteration, before anything is sent) for an invalid
        request, EngineDeadError if the engine is or becomes dead. A request left unfinished is
        aborted in the engine when the iterator is closed: at once if the consumer closes it
        (contextlib.aclosing, as a server should) or is cancelled while it waits for an output;
        else only once the iterator is garbage collected.
        """
        if self.errored:
            raise self.engine_core.dead_error
        if isinstance(prompt, EngineCoreRequest):
            request = prompt
        else:
            request = self.input_processor.process_inputs(
                request_id, prompt, sampling_params, priority=priority,
                data_parallel_rank=data_parallel_rank)
            prompt_text = prompt if isinstance(prompt, str) else None
        queue = RequestOutputCollector()
        state = self.output_processor.add_request(request, prompt_text, queue, trace_headers)
        try:
            if not self._resumed.is_set():
                await self._wait_for_resume(queue)
            if not state.finished:
                state.engine_index = self.engine_core.add_request(request)
        except BaseException:  # the engine is dead, or the consumer left while it waited
            self.output_processor.request_states.pop(request.request_id, None)
            raise
        try:
            while True:
                output = await queue.get()
                yield output
                if output.finished:
                    return
        finally:
            if not state.finished and queue.error is None:
                self._abort([request.request_id])

    async def abort(self, request_id: str) -> None:
        """Abort a request: the engine frees it, and its stream ends with finish_reason "abort".
        Unknown or finished requests are ignored."""
        self._abort([request_id])

    def _abort(self, request_ids: list[str]) -> None:
        aborted = self.output_processor.abort_requests(request_ids)
        if aborted:
            self.engine_core.abort_requests([state.request_id for state in aborted])

    async def call_utility(self, method: str, *args, engine_index: int = 0) -> Any:
        """Call an engine utility method (EngineControl's, minicore/engine/control.py) on one
        engine; ValueError with the engine's message if it refused the call (its arguments, or
        its state), RuntimeError if it failed there."""
        return await self.engine_core.call_utility_async(method, *args, engine_index=engine_index)

    async def call_utility_all(self, method: str, *args) -> list:
        """The utility method on every engine at once; their results, by engine."""
        return list(await asyncio.gather(*(
            self.call_utility(method, *args, engine_index=i) for i in range(self.num_engines))))

    # ---- the control plane ---------------------------------------------------------------------

    async def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True,
                               wait_for_inflight_requests: bool = False) -> None:
        """Hold generation on every engine (vLLM 0.32): "abort" ends the requests in flight with
        finish_reason "abort", "wait" lets them finish, "keep" freezes them until
        resume_generation (clear_cache: their KV is recomputed then). Requests sent meanwhile
        wait. Returns once every engine is idle. wait_for_inflight_requests: vLLM's older
        spelling of mode="wait"."""
        mode = "wait" if wait_for_inflight_requests else mode
        check_pause_mode(mode)
        await self._holding(self.call_utility_all("pause_scheduler", mode, clear_cache))

    async def resume_generation(self) -> None:
        """ValueError while an engine's memory is released: wake_up resumes generation then."""
        await self.call_utility_all("resume_scheduler")
        self._release()

    async def scale_elastic_ep(self, new_data_parallel_size: int,
                               drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        """vLLM's elastic EP (--enable-elastic-ep): grow or shrink the DP group to
        new_data_parallel_size ranks while serving (minicore/dp/elastic_ep.py); new requests
        wait while the ranks re-form it. ValueError if refused (elastic EP off, a size the model
        or the cluster cannot take, a scale under way); TimeoutError if the leaving ranks'
        requests did not finish within drain_timeout seconds (then nothing changed)."""
        if not hasattr(self.engine_core, "commit_scale"):
            raise ValueError("elastic EP is off: serve with --enable-elastic-ep "
                             "(and --data-parallel-backend ray)")
        if self.is_scaling_elastic_ep:
            raise ValueError("the DP group is being scaled already: try again when it is done")
        self.is_scaling_elastic_ep = True
        try:
            await self.engine_core.prepare_scale(new_data_parallel_size)
            if new_data_parallel_size != self.num_engines:
                await self.engine_core.drain(new_data_parallel_size, drain_timeout)
                await self._holding(self.call_utility_all("pause_scheduler", "keep", False))
                await self.engine_core.commit_scale(new_data_parallel_size)
                self.num_engines = self.config.parallel_config.data_parallel_size = (
                    new_data_parallel_size)
                for engine in [e for e in self.latest_stats if e >= new_data_parallel_size]:
                    del self.latest_stats[engine]
                await self.resume_generation()
        finally:
            self.is_scaling_elastic_ep = False

    async def is_paused(self) -> bool:
        return any(await self.call_utility_all("is_scheduler_paused"))

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """Pause (mode) and release memory on every engine: the KV cache, and at level 2 the
        weights (reloaded from the model directory on wake-up); level 0 only pauses."""
        check_sleep_level(level)
        check_pause_mode(mode)
        try:
            await self._holding(self.call_utility_all("sleep", level, mode))
        finally:
            await self._report_sleep_state()

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back "weights", "kv_cache" and/or "scheduling" (None: all) on every engine;
        generation resumes once every engine is whole. Whether they all are (vLLM's
        fully_awake)."""
        wake_tags(tags)
        await self.call_utility_all("wake_up", tags)
        awake = not await self.is_sleeping()
        if awake:
            self._release()
        await self._report_sleep_state()
        return awake

    async def is_sleeping(self) -> bool:
        return any(await self.call_utility_all("is_sleeping"))

    async def release_kv_cache_memory(self) -> None:
        """Free every engine's KV cache memory, once a pause has completed with no request kept;
        wake_up(["kv_cache"]) brings it back and resumes generation (vLLM 0.32)."""
        await self.call_utility_all("release_kv_cache_memory")

    async def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                             args: tuple = (), kwargs: dict | None = None) -> list:
        """Run method on every worker of every engine (a name of the runner's public methods,
        or a function called with the runner first: pickled, so the engines need
        MINICORE_ALLOW_INSECURE_SERIALIZATION=1); one result per worker, by DP rank."""
        results = await self.call_utility_all("collective_rpc", method, timeout, list(args),
                                              kwargs or {})
        return [result for per_engine in results for result in per_engine]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return all(await self.call_utility_all("reset_prefix_cache", reset_running_requests))

    async def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Every engine's runner starts joining the trainer's weight transfer group, through
        collective_rpc as vLLM's workers do (minicore/dp/weight_transfer.py: engine i as rank
        init_info["rank_offset"] + i); the trainer's trainer_init returns once all have."""
        await self.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.collective_rpc("shutdown_weight_transfer_engine")

    async def start_weight_update(self) -> None:
        await self.call_utility_all("start_weight_update")

    async def start_draft_weight_update(self) -> None:
        """vLLM's weight update of a draft model: minicore's drafts (ngram) have no weights."""
        raise ValueError("Draft model weight update requested, but no draft model is configured "
                         "(minicore's drafts are ngram's, without weights)")

    async def update_weights(self, update_info: dict) -> None:
        """Every engine loads new weights in place, between start_weight_update and
        finish_weight_update: update_info["path"] (a local safetensors file or directory), or
        the tensors update_info names as the trainer broadcasts them."""
        await self.call_utility_all("update_weights", update_info)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.call_utility_all("finish_weight_update", weight_version)

    async def get_weight_version(self) -> str:
        return await self.call_utility("get_weight_version")

    async def update_weight_version(self, weight_version: str) -> None:
        await self.call_utility_all("update_weight_version", weight_version)

    async def abort_requests(self, request_ids: list[str] | None = None) -> int:
        """abort for several requests at once (None: every one in flight), each named by its
        id or by its response's (a completion's "cmpl-..." names all its choices); how many."""
        names = set(request_ids or ())
        running = [rid for rid in self.output_processor.request_states
                   if request_ids is None or rid in names or rid.rpartition("-")[0] in names]
        self._abort(running)
        return len(running)

    async def _holding(self, calls) -> None:
        """Hold new requests while calls pause the engines; open again if they fail."""
        was_open = self._resumed.is_set()
        self._resumed.clear()
        try:
            await calls
        except BaseException:
            if was_open:
                self._resumed.set()
            raise

    def _release(self) -> None:
        """Let held requests go, after waking the DP engines for requests they kept."""
        self.engine_core.resume_waves()
        self._resumed.set()

    async def _report_sleep_state(self) -> None:
        if self.on_sleep_state is not None and not self.errored:
            self.on_sleep_state(await self.call_utility_all("get_sleep_level"))

    async def _wait_for_resume(self, queue: RequestOutputCollector) -> None:
        """While the engines are paused or asleep a new request waits here, before any engine
        sees it: until resume, or until it ends here (aborted, or the engine died)."""
        waits = [asyncio.ensure_future(self._resumed.wait()),
                 asyncio.ensure_future(queue.ready.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    # ---- outputs -------------------------------------------------------------------------------

    async def _run_output_handler(self) -> None:
        while True:
            try:
                outputs = await self.engine_core.get_output_async()
            except EngineDeadError:
                return  # every stream has been failed
            self._process_outputs(outputs)
            # A recv of a frame already queued completes without yielding: let the consumers
            # take this output before the next, or an engine that runs ahead starves them.
            await asyncio.sleep(0)

    def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.latest_stats[outputs.engine_index] = outputs.scheduler_stats
        if outputs.outputs:
            processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
            if processed.reqs_to_abort:
                # Stop strings ended them here: the engine does not know.
                self.engine_core.abort_requests(processed.reqs_to_abort)

    def _on_output_handler_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            # Nothing would deliver outputs any more: as good as a dead engine.
            logger.error("the output handler failed", exc_info=error)
            self.engine_core.set_dead(f"the frontend's output handler failed ({error!r})")

    # ---- shutdown ------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop the engines, fail what is still in flight, close the sockets. Idempotent."""
        self.output_handler.cancel()
        await self.engine_core.shutdown()
