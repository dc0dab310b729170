"""Engine configuration: what to schedule, how to cache, how to parallelise.

Mirrors vllm/config/ (SchedulerConfig, CacheConfig, ParallelConfig, ModelConfig, VllmConfig), keeping
only the knobs minicore implements. Pure Python: the scheduler imports it without torch.
"""

from dataclasses import dataclass, field
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority"]
BalanceThreshold = Literal["seed", "full"]


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    # A prefill longer than this is cut into chunks of this size (0: no cap beyond the budget).
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = "fcfs"
    # BalanceScheduler's gate: "seed" stops admission when a rank has max_num_seqs - 1 running
    # (vllm-ascend PR #5212), "full" when a rank is full (vllm-ascend's later fix).
    balance_threshold: BalanceThreshold = "seed"

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.balance_threshold not in ("seed", "full"):
            raise ValueError(f"balance_threshold must be 'seed' or 'full', got {self.balance_threshold!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) without chunked prefill, or long prompts could never run")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # Set by the model runner from the memory it may use, before a Scheduler is built.
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")


@dataclass(slots=True)
class ParallelConfig:
    data_parallel_size: int = 1
    data_parallel_rank: int = 0


@dataclass(slots=True)
class EngineConfig:
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
