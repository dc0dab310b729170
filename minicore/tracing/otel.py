"""vLLM's OpenTelemetry request tracing: one span per finished request, exported over OTLP.

Mirrors vllm/tracing/ (utils.py's SpanAttributes and trace header helpers, otel.py's tracer set-up
and exporter choice) and OutputProcessor.do_tracing of vllm/v1/engine/output_processor.py: a span
"llm_request" (kind SERVER) from the request's arrival to its end, the child of the context its
client sent in the W3C `traceparent`/`tracestate` headers (without them, the root of a new trace),
with vLLM's gen_ai.* attributes: token counts, the request's parameters and the latencies of
RequestStateStats.phase_times (the /metrics histograms' own). The OutputProcessor holds a tracer
bound once: OtelRequestTracer with --otlp-traces-endpoint, NoRequestTracer (nothing) without; the
SDK's BatchSpanProcessor exports from a thread of its own. OpenTelemetry is an optional extra
(minicore[otel]), imported only when tracing is on. Differences: the trace headers stay in the
frontend (vLLM carries them through the engine core and back); the tracer provider is the
tracer's own, not the process's global one; the spans still queued at exit get EXIT_FLUSH_S to
go (vLLM's exit waits for the exporter's retries). Left out: vLLM's instrument decorators and
engine-process tracers; spans of client-aborted requests (none in vLLM either).
"""

import atexit
import importlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from importlib.util import find_spec

logger = logging.getLogger(__name__)

# The W3C trace context headers (vllm/tracing/utils.py).
TRACE_HEADERS = ("traceparent", "tracestate")
# The OTLP protocol, by OpenTelemetry's variable: grpc by default, as vLLM's get_span_exporter.
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
EXPORTERS = {"grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
             "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter"}
OTEL_PACKAGES = "opentelemetry-sdk, opentelemetry-api and opentelemetry-exporter-otlp"
# The longest the exit waits for the last spans to go: the SDK's own exit hook would wait for a
# collector that is down for its export timeout (10 s), and a stopped server exits within seconds.
EXIT_FLUSH_S = 2.0


class SpanAttributes:
    """vLLM's span attribute names (vllm/tracing/utils.py), OpenTelemetry's gen_ai conventions
    and vLLM's own latency breakdown."""
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def get_trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The trace context headers of an HTTP request's, None if it has none (vLLM's
    OpenAIServing._get_trace_headers)."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


def otlp_protocol() -> str:
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol not in EXPORTERS:  # vLLM's message
        raise ValueError(f"Unsupported OTLP protocol '{protocol}' is configured")
    return protocol


def check_otel_available() -> None:
    """ValueError naming the packages when OpenTelemetry's SDK or the protocol's exporter cannot
    be imported (vLLM's check of otlp_traces_endpoint); nothing of them is imported here."""
    needed = ("opentelemetry.sdk", EXPORTERS[otlp_protocol()].rpartition(".")[0])
    try:
        missing = [name for name in needed if find_spec(name) is None]
    except ModuleNotFoundError as e:  # a parent package is missing
        missing = [e.name]
    if missing:
        raise ValueError(f"OpenTelemetry is not available ({', '.join(missing)} cannot be "
                         f"imported): --otlp-traces-endpoint needs {OTEL_PACKAGES}; "
                         "pip install 'minicore[otel]'")


class NoRequestTracer:
    """Tracing off: no spans. A request that brings trace headers is warned about, once, and its
    headers dropped (vLLM's log_tracing_disabled_warning)."""

    def __init__(self):
        self._warned = False

    def accept_headers(self, headers: Mapping[str, str]) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("Received a request with trace context but tracing is disabled")

    def request_finished(self, state) -> None:
        """Nothing to trace."""


class OtelRequestTracer:
    """One span per finished request (an OutputProcessor RequestState), handed to the SDK's
    batch processor, which exports it to endpoint from its own thread."""

    def __init__(self, endpoint: str):
        from opentelemetry.context import Context
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        protocol = otlp_protocol()
        exporter_cls = importlib.import_module(EXPORTERS[protocol]).OTLPSpanExporter
        # vLLM's: no TLS for grpc; an http/protobuf endpoint is the whole URL (.../v1/traces).
        exporter = (exporter_cls(endpoint=endpoint, insecure=True) if protocol == "grpc"
                    else exporter_cls(endpoint=endpoint))
        # vLLM's resource attributes; OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES add theirs.
        provider = TracerProvider(resource=Resource.create({
            "vllm.instrumenting_module_name": "minicore.llm_engine",
            "vllm.process_id": str(os.getpid())}), shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        atexit.register(_flush_at_exit, provider)
        self.tracer = provider.get_tracer("minicore.llm_engine")
        self._propagator = TraceContextTextMapPropagator()
        # The parent of a span without trace headers: none (a new trace), whatever is current.
        self._no_parent = Context()
        self._kind = SpanKind.SERVER
        logger.info("OpenTelemetry request tracing to %s (OTLP %s)", endpoint, protocol)

    def accept_headers(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        return headers

    def request_finished(self, state) -> None:
        """vLLM's do_tracing: the span of a request that ended, from its arrival to now; a
        client's abort gets none, as in vLLM (its abort never reaches do_tracing)."""
        if state.finish_reason == "abort":
            return
        stats, params, a = state.stats, state.sampling_params, SpanAttributes
        phases = stats.phase_times(time.monotonic())
        attributes = {
            a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: stats.first_token_latency,
            a.GEN_AI_LATENCY_E2E: phases.e2e,
            a.GEN_AI_LATENCY_TIME_IN_QUEUE: phases.queue,
            a.GEN_AI_USAGE_PROMPT_TOKENS: len(state.prompt_token_ids),
            a.GEN_AI_USAGE_COMPLETION_TOKENS: stats.num_generation_tokens,
            a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: phases.prefill,
            a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: phases.decode,
            a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: phases.inference,
            a.GEN_AI_REQUEST_ID: state.request_id}
        # As vLLM: a parameter only where it is set and not 0 (temperature 0 is left out).
        for name, value in ((a.GEN_AI_REQUEST_TOP_P, params.top_p),
                            (a.GEN_AI_REQUEST_MAX_TOKENS, params.max_tokens),
                            (a.GEN_AI_REQUEST_TEMPERATURE, params.temperature),
                            (a.GEN_AI_REQUEST_N, params.n)):
            if value:
                attributes[name] = value
        parent = (self._propagator.extract(state.trace_headers) if state.trace_headers
                  else self._no_parent)
        # The wall clock's now less the request's age on the monotonic one: its arrival.
        start_ns = time.time_ns() - round(phases.e2e * 1e9)
        self.tracer.start_span("llm_request", context=parent, kind=self._kind,
                               attributes=attributes, start_time=start_ns).end()


def _flush_at_exit(provider) -> None:
    """Export the spans still queued, waiting EXIT_FLUSH_S at most (vLLM: the SDK's shutdown at
    exit, unbounded)."""
    flush = threading.Thread(target=provider.shutdown, name="otel-flush", daemon=True)
    flush.start()
    flush.join(EXIT_FLUSH_S)


def make_request_tracer(otlp_traces_endpoint: str | None) -> NoRequestTracer | OtelRequestTracer:
    """The OutputProcessor's tracer: OtelRequestTracer with an endpoint, else NoRequestTracer
    (OpenTelemetry's own OTEL_EXPORTER_OTLP_* variables alone turn nothing on, as in vLLM)."""
    if otlp_traces_endpoint is None:
        return NoRequestTracer()
    return OtelRequestTracer(otlp_traces_endpoint)
