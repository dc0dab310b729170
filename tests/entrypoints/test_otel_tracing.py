"""OpenTelemetry request tracing (--otlp-traces-endpoint) against a real OTLP/HTTP receiver in
the test process, which decodes each export with opentelemetry-proto's classes: a served request
with a `traceparent` header arrives as one span, the child of the header's span in its trace, with
vLLM's attribute names and values that fit the response and each other; one without the header is
the root of a trace of its own; a request the client aborted has none. Without the flag nothing
is traced (the client's headers are dropped with one warning), and the flag's checks are vLLM's."""

import gzip
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from server_helpers import ServerProcess
from test_detokenizer import ByteTokenizer

from minicore.config import create_engine_config
from minicore.engine.output_processor import OutputProcessor
from minicore.protocol import EngineCoreOutput, EngineCoreRequest
from minicore.request import FinishReason
from minicore.sampling_params import SamplingParams
from minicore.tracing.otel import (
    PROTOCOL_ENV,
    NoRequestTracer,
    OtelRequestTracer,
    make_request_tracer,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
# vLLM 0.32's span of a request (OutputProcessor.do_tracing, vllm/tracing/utils.py's names).
LATENCIES = ("gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
             "gen_ai.latency.time_in_queue", "gen_ai.latency.time_in_model_prefill",
             "gen_ai.latency.time_in_model_decode", "gen_ai.latency.time_in_model_inference")
ATTRIBUTES = {*LATENCIES, "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
              "gen_ai.request.id", "gen_ai.request.top_p", "gen_ai.request.max_tokens",
              "gen_ai.request.temperature", "gen_ai.request.n"}
# Spans leave the server's batch processor 50 ms after they end (the SDK's default: 5 s).
TRACING_ENV = {PROTOCOL_ENV: "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50"}


class OtlpReceiver:
    """An OTLP/HTTP trace receiver (POST /v1/traces, protobuf) on a free port: every span it was
    sent, with its resource's attributes."""

    def __init__(self):
        self.spans: list[tuple[dict, Span]] = []
        self._received = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.receive(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def receive(self, export: ExportTraceServiceRequest) -> None:
        with self._received:
            for resource_spans in export.resource_spans:
                resource = attributes(resource_spans.resource)
                self.spans += [(resource, span) for scope in resource_spans.scope_spans
                               for span in scope.spans]
            self._received.notify_all()

    def wait_for(self, count: int, timeout: float = 10.0) -> list[tuple[dict, Span]]:
        with self._received:
            self._received.wait_for(lambda: len(self.spans) >= count, timeout)
            return list(self.spans)


def attributes(message) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in message.attributes}


@pytest.fixture(scope="module")
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.server.shutdown()


def check_latencies(span: Span, attrs: dict, sent_ns: int, answered_ns: int) -> None:
    """Every latency >= 0, the phases (one engine clock) inside the request's life (the
    frontend's, the same machine's monotonic clock), and the span from arrival to the end."""
    assert all(attrs[name] >= 0 for name in LATENCIES)
    queue, prefill, decode, inference, e2e, ttft = (attrs[f"gen_ai.latency.{name}"] for name in (
        "time_in_queue", "time_in_model_prefill", "time_in_model_decode",
        "time_in_model_inference", "e2e", "time_to_first_token"))
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert queue + prefill <= ttft <= e2e and queue + inference <= e2e
    assert sent_ns <= span.start_time_unix_nano < span.end_time_unix_nano <= answered_ns
    duration = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
    assert duration == pytest.approx(e2e, abs=0.05)


def test_served_requests_are_spans_with_vllms_attributes(receiver):
    with ServerProcess("--runner", "simulated", "--otlp-traces-endpoint", receiver.url,
                       env=TRACING_ENV) as server:
        sent_ns = time.time_ns()
        traced = httpx.post(server.url + "/v1/completions", timeout=30, headers={
            "traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE"}, json={
            "prompt": "Hello there", "max_tokens": 8, "ignore_eos": True, "temperature": 0.5,
            "top_p": 0.9}).json()
        untraced = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).json()
        answered_ns = time.time_ns()
        spans = receiver.wait_for(2)
        log = server.log()
    assert len(spans) == 2, log
    by_id = {attributes(span)["gen_ai.request.id"]: (resource, span) for resource, span in spans}
    resource, span = by_id[traced["id"] + "-0"]  # the choice's engine request
    attrs = attributes(span)
    assert set(attrs) == ATTRIBUTES and resource["vllm.process_id"].isdigit()
    assert (span.name, span.kind) == ("llm_request", Span.SPAN_KIND_SERVER)
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    assert span.span_id.hex() not in (PARENT_SPAN_ID, "0" * 16)
    assert span.trace_state == "congo=t61rcWkgMzE"
    usage = traced["usage"]
    assert (attrs["gen_ai.usage.prompt_tokens"], attrs["gen_ai.usage.completion_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"]) and usage["completion_tokens"] == 8
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"],
            attrs["gen_ai.request.top_p"], attrs["gen_ai.request.n"]) == (8, 0.5, 0.9, 1)
    check_latencies(span, attrs, sent_ns, answered_ns)
    # No traceparent: the root of a trace of its own (vLLM's: a fresh context).
    _, root = by_id[untraced["id"] + "-0"]
    assert not root.parent_span_id and root.trace_id.hex() not in (TRACE_ID, "0" * 32)
    assert attributes(root)["gen_ai.usage.completion_tokens"] == (
        untraced["usage"]["completion_tokens"])
    check_latencies(root, attributes(root), sent_ns, answered_ns)


def engine_request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(b"hi "), SamplingParams(max_tokens=2), None,
                             time.monotonic())


def test_an_aborted_request_has_no_span(receiver, monkeypatch):
    monkeypatch.setenv(PROTOCOL_ENV, "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    processor = OutputProcessor(ByteTokenizer(), OtelRequestTracer(receiver.url))
    before = len(receiver.spans)
    for request_id in ("aborted", "finished"):
        processor.add_request(engine_request(request_id), None,
                              trace_headers={"traceparent": TRACEPARENT})
    processor.abort_requests(["aborted"])
    processor.process_outputs([EngineCoreOutput("finished", list(b"ok"), FinishReason.LENGTH)])
    spans = receiver.wait_for(before + 1)
    time.sleep(0.1)  # an abort's span, were there one, would have come with the other
    assert [attributes(span)["gen_ai.request.id"] for _, span in receiver.spans[before:]] == [
        "finished"] and spans[-1][1].trace_id.hex() == TRACE_ID


def test_without_the_flag_nothing_is_traced(monkeypatch, caplog):
    # OpenTelemetry's own variable turns nothing on (as in vLLM: only the flag does).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    config = create_engine_config()
    assert config.observability_config.otlp_traces_endpoint is None
    processor = OutputProcessor(ByteTokenizer(), make_request_tracer(None))
    assert type(processor.tracer) is NoRequestTracer
    with caplog.at_level(logging.WARNING, "minicore.tracing.otel"):
        states = [processor.add_request(engine_request(request_id), None,
                                        trace_headers={"traceparent": TRACEPARENT})
                  for request_id in ("a", "b")]
    assert [state.trace_headers for state in states] == [None, None]
    assert caplog.messages == ["Received a request with trace context but tracing is disabled"]


def test_the_flags_checks_are_vllms(monkeypatch):
    with pytest.raises(ValueError, match="requires `--otlp-traces-endpoint` to be set"):
        create_engine_config(collect_detailed_traces=["model"])
    config = create_engine_config(otlp_traces_endpoint="localhost:4317",
                                  collect_detailed_traces=["model", "worker"])
    assert config.observability_config.collect_detailed_traces == ["model", "worker"]
    monkeypatch.setenv(PROTOCOL_ENV, "http/json")
    with pytest.raises(ValueError, match="Unsupported OTLP protocol 'http/json'"):
        create_engine_config(otlp_traces_endpoint="localhost:4317")
    monkeypatch.delenv(PROTOCOL_ENV)
    monkeypatch.setattr("minicore.tracing.otel.find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"opentelemetry-sdk, opentelemetry-api and "
                                         r"opentelemetry-exporter-otlp; pip install "
                                         r"'minicore\[otel\]'"):
        create_engine_config(otlp_traces_endpoint="localhost:4317")
