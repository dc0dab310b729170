"""KV connectors: moving KV cache blocks between engine instances (prefill/decode disaggregation).

Mirrors vllm/distributed/kv_transfer/. The package's own import loads nothing: the scheduler sees a
connector only as the object it is given (base.py's interface, pure Python), and nixl.py imports
NIXL, torch and zmq only when a NixlConnector is built. Left out: every connector but NIXL's, the
v0 connectors, KV events and connector metrics.
"""
