"""minicore: a compact, asyncio-native reimplementation of vLLM v1's engine core for data-parallel
serving. The scheduler is pure Python; the model side (torch, transformers) loads on first use."""

from minicore.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from minicore.sampling_params import SamplingParams

__all__ = ["CacheConfig", "EngineConfig", "ParallelConfig", "SamplingParams", "SchedulerConfig"]
__version__ = "0.1.0"
