"""The frontend's side of each request: engine outputs in, text, finish state and streams out.

Mirrors vllm/v1/engine/output_processor.py: OutputProcessor keeps a RequestState per request,
detokenizes incrementally, applies stop strings (the engine only knows stop tokens, so a stop string
finishes the request here and the caller aborts it in the engine; a request the engine refused ends
its stream with InvalidRequestError, one that failed there with RequestFailedError), keeps each
request's RequestStateStats as vLLM's IterationStats.update_from_output/update_from_events do
(queued and scheduled times from the engine's events, first and last token times from the engine's
frame timestamps, so that queue, prefill, decode and inference times are differences of one engine's
clock; the time to first token is the frontend's own), and hands results over: to the request's
RequestOutputCollector (AsyncLLM's streams) or, for a request without one (the offline LLM), as a
RequestOutput once it finishes. Streaming holds back the last len(longest stop string) - 1
characters until they cannot start a stop string any more (nothing is held back with
include_stop_str_in_output). Logprobs go through each request's LogprobsProcessor
(minicore/engine/logprobs.py); a RequestOutput carries all of them so far. An engine output that
only carries prompt logprobs (a chunked prefill) wakes no stream: they come with the first token, as
vLLM returns them at the end of prefill. Each finished request goes to the request tracer bound
at construction (minicore/tracing/otel.py: OpenTelemetry spans, or NoRequestTracer), as vLLM's
do_tracing. Left out: n > 1 fan-out (the offline LLM's), pooling outputs, iteration stats objects
(the metrics hooks below take their place).
"""

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from minicore.engine.detokenizer import IncrementalDetokenizer
from minicore.engine.input_processor import InvalidRequestError
from minicore.engine.logprobs import LogprobsProcessor
from minicore.outputs import CompletionOutput, RequestOutput, RequestStateStats
from minicore.protocol import EngineCoreEventType, EngineCoreOutput, EngineCoreRequest, FinishReason
from minicore.sampling_params import SamplingParams
from minicore.tracing.otel import NoRequestTracer, OtelRequestTracer


class RequestFailedError(RuntimeError):
    """One request failed in the engine, which serves on (vLLM's finish_reason "error"): a
    server error, where InvalidRequestError is the caller's."""


def _request_error(output: EngineCoreOutput) -> Exception:
    if output.failed:
        return RequestFailedError(f"request {output.request_id!r} failed in the engine: "
                                  f"{output.error_message}")
    return InvalidRequestError(f"the engine refused request {output.request_id!r}: "
                               f"{output.error_message}")


class RequestOutputCollector:
    """One request's one-slot queue: the output side marks it ready after each output; the
    consumer takes the newest state (a consumer that falls behind gets the newest state, not a
    backlog), or the error that ended it."""

    __slots__ = ("error", "ready", "state")

    def __init__(self):
        self.state: RequestState | None = None
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


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer, arrival_time: float | None = None,
                 queue: RequestOutputCollector | None = None):
        self.request_id = request_id
        # The DP rank that runs it.
        self.engine_index = 0
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.queue = queue
        if queue is not None:
            queue.state = self
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens)
        self.stop_buffer_length = (0 if params.include_stop_str_in_output
                                   else max(map(len, params.stop), default=1) - 1)
        self.logprobs_processor = (
            None if params.logprobs is None and params.prompt_logprobs is None
            else LogprobsProcessor(tokenizer, params))
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        # The KV connector's params from the engine's final output (disaggregated prefill).
        self.kv_transfer_params: dict | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.sampling_params = params
        self.stats = RequestStateStats(arrival_time=self.arrival_time)
        # The client's W3C trace context headers, kept for its span when tracing is on.
        self.trace_headers: Mapping[str, str] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, output: EngineCoreOutput) -> bool:
        """Take one engine output; True if a stop string ended the request here (the caller must
        then abort it in the engine, which does not know it is done)."""
        self.token_ids.extend(output.new_token_ids)
        self.num_cached_tokens = output.num_cached_tokens
        if self.logprobs_processor is not None:
            self.logprobs_processor.update_from_output(output)
        if output.finished:
            self.finish_reason, self.stop_reason = str(output.finish_reason), output.stop_reason
            self.kv_transfer_params = output.kv_transfer_params
        stop = self.detokenizer.update(output.new_token_ids,
                                       output.finish_reason == FinishReason.STOP)
        if stop is None:
            return False
        stopped_here = not output.finished
        self.finish_reason, self.stop_reason = "stop", stop
        return stopped_here

    def update_stats(self, output: EngineCoreOutput, engine_core_timestamp: float) -> float | None:
        """Take the output's engine events and its frame's timestamp into self.stats (vLLM's
        IterationStats.update_from_output and update_from_events); returns the inter-token
        latency (engine clock), None for the first tokens or an output without tokens."""
        stats = self.stats
        for event in output.events or ():
            if event.type == EngineCoreEventType.QUEUED:
                stats.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED:
                if not stats.scheduled_ts:  # rescheduled after a preemption: keep the first
                    stats.scheduled_ts = event.timestamp
            else:
                stats.num_preemptions += 1
        if not output.new_token_ids:
            return None
        interval = None
        if not stats.num_generation_tokens:
            stats.first_token_latency = time.monotonic() - stats.arrival_time
            stats.first_token_ts = engine_core_timestamp
        else:
            interval = engine_core_timestamp - stats.last_token_ts
        stats.num_generation_tokens += len(output.new_token_ids)
        stats.last_token_ts = engine_core_timestamp
        return interval

    def streamable_text(self) -> str:
        """The text that can be sent: all of it once finished, else all but what could still turn
        out to be the start of a stop string."""
        text = self.detokenizer.output_text
        if self.finished or not self.stop_buffer_length:
            return text
        return text[:max(0, len(text) - self.stop_buffer_length)]

    def make_request_output(self) -> RequestOutput:
        completion = CompletionOutput(0, self.streamable_text(), list(self.token_ids),
                                      self.finish_reason, self.stop_reason)
        prompt_logprobs = None
        if (lp := self.logprobs_processor) is not None:
            if lp.logprobs is not None:
                completion.logprobs = lp.logprobs[:len(self.token_ids)]
                completion.cumulative_logprob = lp.cumulative_logprob
            prompt_logprobs = None if lp.prompt_logprobs is None else list(lp.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             self.finished, self.num_cached_tokens, self.kv_transfer_params,
                             prompt_logprobs, self.stats)


@dataclass(slots=True)
class OutputProcessorOutput:
    # Finished requests that have no collector (the offline LLM's).
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Requests a stop string finished here: the caller aborts them in the engine.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Hooks for metrics (plain attributes, None by default), called as outputs are processed:
      on_new_tokens(state, num_new_tokens, interval_s): after each engine output that brought
        tokens; interval_s is the inter-token latency since the request's previous output (engine
        clock), None for its first (then state.stats.first_token_latency is the time to first
        token).
      on_request_finished(state): once per request that finished (state.finish_reason "stop",
        "length", "error" or "abort"), aborts included; not for requests failed by a dead engine.
      on_iteration_end(): after each process_outputs call (one engine frame: vLLM's iteration).
    """

    def __init__(self, tokenizer, tracer: NoRequestTracer | OtelRequestTracer | None = None):
        self.tokenizer = tokenizer
        # Makes each finished request's span (--otlp-traces-endpoint), or nothing.
        self.tracer = tracer or NoRequestTracer()
        self.request_states: dict[str, RequestState] = {}
        self.on_new_tokens: Callable[[RequestState, int, float | None], None] | None = None
        self.on_request_finished: Callable[[RequestState], None] | None = None
        self.on_iteration_end: Callable[[], None] | None = None

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(self, request: EngineCoreRequest, prompt: str | None,
                    queue: RequestOutputCollector | None = None,
                    trace_headers: Mapping[str, str] | None = None) -> RequestState:
        """trace_headers: the client's traceparent/tracestate (get_trace_headers), if any."""
        if request.request_id in self.request_states:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        state = RequestState(request.request_id, prompt, request.prompt_token_ids,
                             request.sampling_params, self.tokenizer, request.arrival_time, queue)
        if trace_headers:
            state.trace_headers = self.tracer.accept_headers(trace_headers)
        self.request_states[request.request_id] = state
        return state

    def process_outputs(self, outputs: Iterable[EngineCoreOutput],
                        engine_core_timestamp: float | None = None) -> OutputProcessorOutput:
        """engine_core_timestamp: the frame's EngineCoreOutputs.timestamp (the engine's
        time.monotonic()); None in the engine's own process (the offline LLM): now."""
        if engine_core_timestamp is None:
            engine_core_timestamp = time.monotonic()
        result = OutputProcessorOutput()
        states = self.request_states
        for output in outputs:
            if (state := states.get(output.request_id)) is None:
                continue  # aborted here while the engine was producing it
            interval = state.update_stats(output, engine_core_timestamp)
            if state.process(output):
                result.reqs_to_abort.append(output.request_id)
            if self.on_new_tokens is not None and output.new_token_ids:
                self.on_new_tokens(state, len(output.new_token_ids), interval)
            if state.queue is not None and (output.new_token_ids or state.finished):
                if output.finish_reason is FinishReason.ERROR:
                    state.queue.fail(_request_error(output))
                else:
                    state.queue.notify()
            if state.finished:
                self._finish(state)
                if state.queue is None:
                    result.request_outputs.append(state.make_request_output())
        if self.on_iteration_end is not None:
            self.on_iteration_end()
        return result

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestState]:
        """Finish these requests here as "abort" (their streams end); returns the states of those
        that were unfinished, which the caller aborts in the engine. Unknown ids are ignored."""
        aborted = []
        for request_id in request_ids:
            if (state := self.request_states.get(request_id)) is not None:
                state.finish_reason = "abort"
                if state.queue is not None:
                    state.queue.notify()
                self._finish(state)
                aborted.append(state)
        return aborted

    def _finish(self, state: RequestState) -> None:
        del self.request_states[state.request_id]
        self.tracer.request_finished(state)
        if self.on_request_finished is not None:
            self.on_request_finished(state)

    def fail_all(self, error: BaseException) -> None:
        """The engine is gone: every stream ends with error (no finish hook runs)."""
        for state in self.request_states.values():
            if state.queue is not None:
                state.queue.fail(error)
        self.request_states.clear()
