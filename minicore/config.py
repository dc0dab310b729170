"""Engine configuration: what to schedule, how to cache, how to parallelise.

Mirrors vllm/config/ (SchedulerConfig, CacheConfig, ParallelConfig, ModelConfig, VllmConfig), keeping
only the knobs minicore implements. Pure Python: the scheduler imports it without torch.

Each user-facing field carries its --help text in its metadata, from which
minicore/engine/arg_utils.py makes the flags, so every default is written once, here. Fields set at
run time get no flag: cache_config.num_blocks (EngineCore, once its runner has sized the KV cache)
and parallel_config.data_parallel_rank (each engine process, for its own rank).
"""

from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from minicore.arg_utils import (
    check_generation_config,
    diff_sampling_param,
    human_readable_int,
    human_readable_int_or_auto,
    read_generation_config,
    resolve_chat_template,
)
from minicore.kv_transfer.config import KVTransferConfig
from minicore.model.registry import MODEL_RUNNERS, runner_info

BalanceThreshold = Literal["full", "one-short"]
BalanceCountSync = Literal["all-gather", "all-reduce-max"]
# --runner's choices: the registry's names (minicore/model/registry.py).
ModelRunnerKind = Literal[tuple(MODEL_RUNNERS)]
# vLLM's --dtype choices; "auto" is bfloat16 on CUDA and float32 on CPU, resolved where torch is
# (minicore.model.loader), since this module stays pure Python.
ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]



def _flag(default, help: str, **cli) -> Any:
    """A field with a command-line flag. cli: flag= (its name, when not --field-name), aliases=
    (short forms), group= (its --help group, when not its config's), type= (argparse's, when not the
    annotation's)."""
    return field(default=default, metadata={"help": help, **cli})


# The metadata of a field set at run time (see the module docstring): no flag.
_RUNTIME = {"cli": False}


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = _flag(256, "most requests running at once")
    # type=: vLLM's human-readable integers (32k, 1K) for the token counts it reads that way.
    max_num_batched_tokens: int = _flag(8192, "most tokens one step computes, over all requests",
                                        type=human_readable_int)
    max_model_len: int = _flag(2048, "a request's most tokens, prompt and output (32k: 32000, 32K: "
                                     "32768; auto: the model's)", type=human_readable_int_or_auto)
    long_prefill_token_threshold: int = _flag(
        0, "cut a prefill longer than this into chunks of this size; 0: no cap beyond the step's "
           "token budget")
    enable_chunked_prefill: bool = _flag(
        True, "split a prompt over steps when it does not fit one step's token budget")
    scheduler_reserve_full_isl: bool = _flag(
        True, "admit a waiting request only when the KV cache has room for its whole current "
              "sequence, not just for the chunk scheduled now (vLLM's default)")
    # A name from minicore/scheduler/policies/, checked when the Scheduler is built: importing the
    # policies here would be an import circle (the scheduler imports this module).
    policy: str = _flag(
        "fcfs", "the scheduling policy: the waiting queue's order and the preemption victim",
        flag="--scheduling-policy")
    # BalanceScheduler instead of Scheduler. Listed with the data-parallel flags: it balances ranks.
    balance_scheduling: bool = _flag(
        False, "hold back admission on every rank while one is full, or nearly: see "
               "--balance-threshold (vllm-ascend's balance scheduling)", group="data parallel")
    balance_threshold: BalanceThreshold = _flag(
        "full", "full: gate while some rank is full, max_num_seqs running (vllm-ascend PR #5212, "
                "the variant behind its published result); one-short: while some rank has "
                "max_num_seqs - 1 or more (vllm-ascend PR #7611, reverted in #8675 after a "
                "first-token latency regression)", group="data parallel")
    # The gate reads only the maximum running count, so one integer all-reduced (MAX) gives the
    # decisions the gathered list does, for less (gloo's all-gather costs more: docs/BENCHMARKS.md).
    # The all-gather stays the default because it is vllm-ascend's.
    balance_count_sync: BalanceCountSync = _flag(
        "all-gather", "how the balance gate learns the ranks' running counts: all-gather: every "
                      "rank's count, as vllm-ascend does; all-reduce-max: only the largest, the "
                      "same decisions for one integer", group="data parallel")

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1 and (name, getattr(self, name)) != ("max_model_len", -1):
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")
        if self.balance_threshold not in ("full", "one-short"):
            raise ValueError("balance_threshold must be 'full' or 'one-short', got "
                             f"{self.balance_threshold!r}")
        if self.balance_count_sync not in ("all-gather", "all-reduce-max"):
            raise ValueError("balance_count_sync must be 'all-gather' or 'all-reduce-max', got "
                             f"{self.balance_count_sync!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) without chunked prefill, or long prompts could never run")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = _flag(16, "tokens per KV cache block")
    # Set by the model runner from the memory it may use, before a Scheduler is built.
    num_blocks: int | None = field(default=None, metadata=_RUNTIME)
    enable_prefix_caching: bool = _flag(
        True, "reuse the KV cache blocks of a prompt prefix computed before")
    kv_cache_memory: int = _flag(1 << 30, "KV cache bytes on CPU (4G: 4*2^30, 4g: 4*10^9)",
                                 type=human_readable_int)
    gpu_memory_utilization: float = _flag(
        0.9, "the fraction of the GPU's memory the engine may use on CUDA; the KV cache gets what "
             "the profiling forward leaves over")
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
    model: str | None = _flag(
        None, "safetensors directory or .gguf file (default: SmolLM2-135M-Instruct)")
    tokenizer: str | None = _flag(
        None, "a local tokenizer directory, when not the model's own (default: the model's)")
    dtype: ModelDType = _flag(
        "auto", "the weights' dtype; auto: bfloat16 on CUDA, float32 on CPU; half is float16, "
                "float is float32")
    device: str | None = _flag(None, "cpu, cuda or cuda:N (default: CUDA when available)")
    seed: int = _flag(0, "seeds the engine's random state, as vLLM's --seed: requests that bring "
                         "no seed of their own sample from it, so a fresh engine repeats them")
    max_logprobs: int = _flag(
        20, "most logprobs (and prompt logprobs) one request may ask for per token, as vLLM's "
            "--max-logprobs; -1: no bound (the whole vocabulary)")
    chat_template: str | None = _flag(
        None, "the chat template: a file's path, or the template itself (default: the "
              "tokenizer's)")
    generation_config: str = _flag(
        "auto", "where unset sampling fields take their defaults from, as vLLM's flag: auto: the "
                "model's generation_config.json (temperature, top_p, top_k, min_p, penalties, "
                "max_new_tokens); vllm: vLLM's neutral defaults; or a folder holding a "
                "generation_config.json. Its eos_token_id list adds stop ids in every mode")
    trust_remote_code: bool = _flag(
        False, "accepted for vLLM's command lines; no effect: minicore runs only the model "
               "classes built into transformers and never runs a model's own code")
    enforce_eager: bool = _flag(
        False, "accepted for vLLM's command lines; no effect: minicore always runs eagerly (it "
               "captures no CUDA graphs)")
    runner: ModelRunnerKind = _flag(
        "transformers", "; ".join(f"{name}: {info.help}" for name, info in MODEL_RUNNERS.items()))
    simulated_cost: SimulatedCost = field(default_factory=SimulatedCost, metadata={
        "help": "the simulated runner's step time, e.g. "
                '\'{"step_s": 0.01, "prefill_token_s": 1e-5, "decode_seq_s": 1e-4}\''})

    def __post_init__(self):
        runner_info(self.runner)  # an unknown runner: ValueError naming the choices
        if self.dtype not in get_args(ModelDType):
            raise ValueError(f"dtype must be one of {', '.join(get_args(ModelDType))}, "
                             f"got {self.dtype!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        check_generation_config(self.generation_config)
        resolve_chat_template(self.chat_template)  # a file that cannot be read: refused now

    def try_get_generation_config(self) -> dict:
        """--generation-config's generation_config.json (the model's for auto and vllm: its
        eos_token_id matters in every mode, as in vLLM), {} if there is none. The model is read
        once resolved to its directory (a GGUF's conversion), as the server and LLM do first."""
        if self.generation_config not in ("auto", "vllm"):
            return read_generation_config(self.generation_config)
        return {} if self.model is None else read_generation_config(self.model)

    def get_diff_sampling_param(self) -> dict:
        """The generation config's defaults for unset sampling fields ({} with vllm)."""
        if self.generation_config == "vllm":
            return {}
        return diff_sampling_param(self.try_get_generation_config())


@dataclass(slots=True)
class ParallelConfig:
    data_parallel_size: int = _flag(
        1, "number of engine replicas (DP ranks), on every machine together", aliases=("-dp",))
    data_parallel_rank: int = field(default=0, metadata=_RUNTIME)
    # vLLM's flags, so that its command lines run: 1 is what minicore does, anything else is
    # refused (one model replica per process; data parallelism is its only parallelism).
    tensor_parallel_size: int = _flag(
        1, "accepted as 1 only: minicore has no tensor parallelism", aliases=("-tp",))
    pipeline_parallel_size: int = _flag(
        1, "accepted as 1 only: minicore has no pipeline parallelism", aliases=("-pp",))
    # A frontend's local ranks start at 0; ranks on other machines start headless.
    data_parallel_size_local: int | None = _flag(
        None, "DP ranks to start on this machine (default: all, from the start rank on)",
        aliases=("-dpl",))
    data_parallel_start_rank: int = _flag(
        0, "the first DP rank started on this machine (with --headless)", aliases=("-dpr",))
    data_parallel_address: str = _flag(
        "127.0.0.1", "the frontend machine's address, which every rank connects to",
        aliases=("-dpa",))
    # Rank 0 hosts the torch.distributed rendezvous; the frontend listens for the engines of every
    # machine on the port after it.
    data_parallel_rpc_port: int = _flag(
        29550, "the DP group's rendezvous port; the engines' handshake is on the next",
        aliases=("-dpp",))
    # vLLM's flag (vllm/engine/arg_utils.py). As in vLLM's DP deployments, the expert-parallel
    # group is the DP ranks themselves (minicore/model/expert_parallel.py).
    enable_expert_parallel: bool = _flag(
        False, "shard every mixture-of-experts layer's experts over the DP ranks (expert "
               "parallelism): each rank holds 1/N of them, and every forward, dummy ones "
               "included, exchanges tokens with the other ranks; needs --data-parallel-size >= 2 "
               "and a Qwen3-MoE, Qwen2-MoE, Mixtral or OLMoE model")

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} {getattr(self, name)} is not supported by minicore: "
                                 "only 1 (scale out with --data-parallel-size)")
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
        if self.enable_expert_parallel and self.data_parallel_size < 2:
            raise ValueError("expert parallelism shards the experts over the data-parallel ranks: "
                             "--enable-expert-parallel needs --data-parallel-size >= 2")

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
    # Prefill/decode disaggregation's settings, kept in their own record (vLLM: VllmConfig's).
    kv_transfer_config: KVTransferConfig | None = None

    def __post_init__(self):
        if self.scheduler_config.balance_scheduling and self.parallel_config.data_parallel_size < 2:
            raise ValueError("balance scheduling balances data-parallel ranks: it needs "
                             "data_parallel_size >= 2")
        runner = self.model_config.runner
        if self.parallel_config.enable_expert_parallel and not runner_info(
                runner).supports_expert_parallel:
            able = " or ".join(n for n, i in MODEL_RUNNERS.items() if i.supports_expert_parallel)
            raise ValueError(f"the {runner} runner has no experts to shard: "
                             f"--enable-expert-parallel needs --runner {able}")


# EngineConfig's sub-configs, with the titles of their flags' --help groups.
SUB_CONFIGS = (("model_config", ModelConfig, "model"),
                ("scheduler_config", SchedulerConfig, "scheduler"),
                ("cache_config", CacheConfig, "cache"),
                ("parallel_config", ParallelConfig, "data parallel"))


def create_engine_config(**kwargs) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (vLLM's EngineArgs names), each routed to
    the sub-config that has a field of that name. scheduling_policy is vLLM's name for policy."""
    if "scheduling_policy" in kwargs:
        kwargs["policy"] = kwargs.pop("scheduling_policy")
    parts = {"kv_transfer_config": kwargs.pop("kv_transfer_config", None)}
    for name, cls, _ in SUB_CONFIGS:
        names = {f.name for f in fields(cls)}
        parts[name] = cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    if kwargs:
        raise TypeError(f"unknown engine argument(s): {', '.join(sorted(kwargs))}")
    return EngineConfig(**parts)
