"""Engine configuration: what to schedule, how to cache, how to parallelise.

Mirrors vllm/config/ (SchedulerConfig, CacheConfig, ParallelConfig, ModelConfig, VllmConfig), keeping
only the knobs minicore implements. Pure Python: the scheduler imports it without torch.
"""

from dataclasses import dataclass, field, fields
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority"]
BalanceThreshold = Literal["seed", "full"]
ModelRunnerKind = Literal["transformers", "simulated"]


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    # A prefill longer than this is cut into chunks of this size (0: no cap beyond the budget).
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = "fcfs"
    # Data parallel only: BalanceScheduler instead of Scheduler (vllm-ascend's balance scheduling).
    balance_scheduling: bool = False
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
    # KV cache size: on CPU a fixed number of bytes; on CUDA a fraction of the GPU's memory, what
    # the profiling forward leaves over.
    kv_cache_memory: int = 1 << 30
    gpu_memory_utilization: float = 0.9

    def __post_init__(self):
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")


@dataclass(slots=True)
class SimulatedCost:
    """The simulated runner's step time in seconds: step_s + prefill_token_s per prefill token +
    decode_seq_s per decoding request. All 0: every step returns at once."""
    step_s: float = 0.0
    prefill_token_s: float = 0.0
    decode_seq_s: float = 0.0

    def __post_init__(self):
        for name in ("step_s", "prefill_token_s", "decode_seq_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")


@dataclass(slots=True)
class ModelConfig:
    # A safetensors directory or a .gguf file; None is the default SmolLM2-135M-Instruct.
    model: str | None = None
    # None: float32 on CPU, bfloat16 on CUDA.
    dtype: str | None = None
    # None: CUDA when available.
    device: str | None = None
    # Seeds the sampler of requests that bring no seed of their own.
    seed: int = 0
    # "simulated": no weights, made-up tokens after a modelled delay (minicore.model.simulated),
    # for studying the IO path and scheduling policies. The tokenizer is still the model's.
    runner: ModelRunnerKind = "transformers"
    simulated_cost: SimulatedCost = field(default_factory=SimulatedCost)

    def __post_init__(self):
        if self.runner not in ("transformers", "simulated"):
            raise ValueError(f"runner must be 'transformers' or 'simulated', got {self.runner!r}")


@dataclass(slots=True)
class ParallelConfig:
    data_parallel_size: int = 1
    # Each engine process sets its own rank.
    data_parallel_rank: int = 0
    # Ranks started on this machine (None: all of them), from data_parallel_start_rank on. A
    # frontend's local ranks start at 0; ranks on other machines start headless.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    # Where the frontend listens for the engines of every machine: the engines' handshake at
    # rpc_port + 1, and the DP group's torch.distributed rendezvous (hosted by rank 0) at rpc_port.
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550

    def __post_init__(self):
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = self.data_parallel_size - self.data_parallel_start_rank
        if not 0 <= self.data_parallel_start_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_start_rank must be in [0, {self.data_parallel_size}), "
                             f"got {self.data_parallel_start_rank}")
        last = self.data_parallel_start_rank + self.data_parallel_size_local
        if self.data_parallel_size_local < 0 or last > self.data_parallel_size:
            raise ValueError(
                f"data_parallel_size_local ({self.data_parallel_size_local}) from start rank "
                f"{self.data_parallel_start_rank} does not fit in data_parallel_size "
                f"({self.data_parallel_size})")
        if not 0 < self.data_parallel_rpc_port < 65535:
            raise ValueError(f"data_parallel_rpc_port must be in (0, 65535), "
                             f"got {self.data_parallel_rpc_port}")

    @property
    def local_ranks(self) -> range:
        return range(self.data_parallel_start_rank,
                     self.data_parallel_start_rank + self.data_parallel_size_local)


@dataclass(slots=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self):
        if self.scheduler_config.balance_scheduling and self.parallel_config.data_parallel_size < 2:
            raise ValueError("balance scheduling balances data-parallel ranks: it needs "
                             "data_parallel_size >= 2")


def create_engine_config(**kwargs) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (vLLM's EngineArgs names), each routed to
    the sub-config that has a field of that name. scheduling_policy is vLLM's name for policy."""
    if "scheduling_policy" in kwargs:
        kwargs["policy"] = kwargs.pop("scheduling_policy")
    parts = {}
    for name, cls in (("model_config", ModelConfig), ("scheduler_config", SchedulerConfig),
                      ("cache_config", CacheConfig), ("parallel_config", ParallelConfig)):
        names = {f.name for f in fields(cls)}
        parts[name] = cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    if kwargs:
        raise TypeError(f"unknown engine argument(s): {', '.join(sorted(kwargs))}")
    return EngineConfig(**parts)
