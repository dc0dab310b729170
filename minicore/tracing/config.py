"""Observability settings: where the request spans go (--otlp-traces-endpoint), and where the
engines' step trace goes (--trace-steps, minicore's own: minicore/tracing/step_tracer.py).

Mirrors the tracing fields of vllm/config/observability.py and their checks: an endpoint needs
OpenTelemetry's packages (minicore[otel]), named in the error when they are missing, and
--collect-detailed-traces needs an endpoint. Left out: that record's metrics fields (hidden
metrics, KV cache residency, MFU, CUDA graph metrics, NVTX ranges), none of which minicore has.
"""

import os
from dataclasses import dataclass
from typing import Literal, get_args

from minicore.arg_utils import flag
from minicore.tracing.otel import check_otel_available
from minicore.tracing.step_trace import DEFAULT_LIMIT

DetailedTraceModules = Literal["model", "worker", "all"]


@dataclass(slots=True)
class ObservabilityConfig:
    otlp_traces_endpoint: str | None = flag(
        None, "target URL to which OpenTelemetry traces will be sent, one span per request (as "
              "vLLM's; the protocol is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL's, grpc by default: "
              "host:4317; http/protobuf: http://host:4318/v1/traces); needs minicore[otel]")
    collect_detailed_traces: list[DetailedTraceModules] | None = flag(
        None, "accepted for vLLM's command lines (model, worker, all; needs "
              "--otlp-traces-endpoint); no effect: vLLM 0.32 adds nothing to its spans with it")

    # minicore's own (issue 46): every engine process appends to one file.
    trace_steps: str | None = flag(
        None, "minicore's own: every engine process appends its steps to this file as Trace "
              "Event Format (ui.perfetto.dev and chrome://tracing open it; `python -m minicore "
              "trace-view` draws it): a track per DP rank (steps, dummy batches, waits in "
              "collectives, KV usage, waves) and one per request; replaced at startup, written "
              "off the busy loop, at most --trace-steps-limit records a process")
    trace_steps_limit: int = flag(
        DEFAULT_LIMIT, "the most records each engine process writes to --trace-steps, then a "
                       "`trace truncated` mark (a record is some 200 bytes, a step's 15 more a "
                       "request in its batch: the default is about 200 MB a process)")

    def __post_init__(self):
        if self.trace_steps is not None:  # every process reads it from its own directory
            self.trace_steps = os.path.abspath(self.trace_steps)
        if self.trace_steps_limit < 1:
            raise ValueError(f"trace_steps_limit must be at least 1, got {self.trace_steps_limit}")
        if self.collect_detailed_traces:
            allowed = get_args(DetailedTraceModules)
            if bad := [m for m in self.collect_detailed_traces if m not in allowed]:
                raise ValueError(f"collect_detailed_traces: {bad[0]!r} is not one of "
                                 f"{', '.join(allowed)}")
            if not self.otlp_traces_endpoint:  # vLLM's check and message
                raise ValueError(
                    "collect_detailed_traces requires `--otlp-traces-endpoint` to be set.")
        if self.otlp_traces_endpoint is not None:
            check_otel_available()
