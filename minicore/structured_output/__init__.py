"""Structured outputs: the constraint a request gives (params.py) and the engine-core manager that
enforces it on xgrammar (manager.py). Mirrors vllm/v1/structured_output/."""
