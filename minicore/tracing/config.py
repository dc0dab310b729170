"""Observability settings: where the request spans go (--otlp-traces-endpoint).

Mirrors the tracing fields of vllm/config/observability.py and their checks: an endpoint needs
OpenTelemetry's packages (minicore[otel]), named in the error when they are missing, and
--collect-detailed-traces needs an endpoint. Left out: that record's metrics fields (hidden
metrics, KV cache residency, MFU, CUDA graph metrics, NVTX ranges), none of which minicore has.
"""

from dataclasses import dataclass
from typing import Literal, get_args

from minicore.arg_utils import flag
from minicore.tracing.otel import check_otel_available

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

    def __post_init__(self):
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
