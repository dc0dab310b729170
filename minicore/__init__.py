"""minicore: a compact, asyncio-native reimplementation of vLLM v1's engine core for data-parallel
serving. The scheduler is pure Python; the model side (torch, transformers) loads on first use."""

import importlib

__version__ = "0.1.0"
# Imported on first use, as vLLM's top-level attributes (vllm/__init__.py, MODULE_ATTRS): importing
# minicore.scheduler must not import the engine's configs and, through them, every feature.
MODULE_ATTRS = {"LLM": "minicore.llm", "CacheConfig": "minicore.config",
                "EngineConfig": "minicore.config", "ParallelConfig": "minicore.config",
                "SchedulerConfig": "minicore.config", "SamplingParams": "minicore.sampling_params"}
__all__ = sorted(MODULE_ATTRS)


def __getattr__(name: str):
    if (module := MODULE_ATTRS.get(name)) is None:
        raise AttributeError(f"module 'minicore' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
