"""Tracing: each engine step as Trace Event Format records (step_trace.py) and pictures of them
(view.py); vLLM's OpenTelemetry request spans (otel.py)."""
