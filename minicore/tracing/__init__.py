"""Tracing: each engine step as Trace Event Format records (step_trace.py: the writer and the
schema; step_tracer.py: what an engine's steps write, --trace-steps; clock.py: the DP ranks'
clocks) and pictures of them (view.py); vLLM's OpenTelemetry request spans (otel.py)."""
