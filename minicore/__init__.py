"""minicore: a compact, asyncio-native reimplementation of vLLM v1's engine core for data-parallel
serving. The scheduler is pure Python; the model side (torch, transformers) loads on first use."""

from minicore.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from minicore.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CacheConfig", "EngineConfig", "ParallelConfig", "SamplingParams",
           "SchedulerConfig"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for, so that the scheduler
    # and the records stay importable without them.
    if name == "LLM":
        from minicore.llm import LLM

        return LLM
    raise AttributeError(f"module 'minicore' has no attribute {name!r}")
