"""Engine configuration: what to schedule, how to cache, how to parallelise.

Mirrors vllm/config/ (SchedulerConfig, CacheConfig, ParallelConfig, VllmConfig; ModelConfig is in
model/config.py), with only minicore's knobs. Pure Python, without torch. The scheduler reads the
records it is given and imports none of this (nor the feature configs below).

Each user-facing field carries its --help text in its metadata, from which
minicore/engine/arg_utils.py makes the flags, so every default is written once, here. Fields set at
run time get no flag: cache_config.num_blocks (EngineCore, once its runner has sized the KV cache)
and parallel_config.data_parallel_rank (each engine process, for its own rank).
"""

from dataclasses import dataclass, field, fields, replace
from typing import Literal

from minicore.arg_utils import (
    RUNTIME,
    check_at_least,
    check_choices,
    config_record,
    flag,
    human_readable_int,
    human_readable_int_or_auto,
)
from minicore.kv_transfer.config import KVTransferConfig
from minicore.model.config import ModelConfig
from minicore.model.registry import MODEL_RUNNERS, runner_info
from minicore.spec_decode.config import SpeculativeConfig
from minicore.structured_output.config import StructuredOutputsConfig
from minicore.tracing.config import ObservabilityConfig

BalanceThreshold = Literal["full", "one-short"]
BalanceCountSync = Literal["all-gather", "all-reduce-max"]
DataParallelBackend = Literal["mp", "ray"]


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = flag(256, "most requests running at once")
    # type=: vLLM's human-readable integers (32k, 1K) for the token counts it reads that way.
    max_num_batched_tokens: int = flag(8192, "most tokens one step computes, over all requests",
                                        type=human_readable_int)
    max_model_len: int = flag(2048, "a request's most tokens, prompt and output (32k: 32000, 32K: "
                                     "32768; auto: the model's)", type=human_readable_int_or_auto)
    long_prefill_token_threshold: int = flag(
        0, "cut a prefill longer than this into chunks of this size; 0: no cap beyond the step's "
           "token budget")
    enable_chunked_prefill: bool = flag(
        True, "split a prompt over steps when it does not fit one step's token budget")
    scheduler_reserve_full_isl: bool = flag(
        True, "admit a waiting request only when the KV cache has room for its whole current "
              "sequence, not just for the chunk scheduled now (vLLM's default)")
    # A name from minicore/scheduler/policies/, checked when the Scheduler is built (a policy
    # registers itself as its file is imported: the policies stay off the config's imports).
    policy: str = flag(
        "fcfs", "the scheduling policy: the waiting queue's order and the preemption victim",
        flag="--scheduling-policy")
    # BalanceScheduler instead of Scheduler. Listed with the data-parallel flags: it balances ranks.
    balance_scheduling: bool = flag(
        False, "hold back admission on every rank while one is full, or nearly: see "
               "--balance-threshold (vllm-ascend's balance scheduling)", group="data parallel")
    balance_threshold: BalanceThreshold = flag(
        "full", "full: gate while some rank is full, max_num_seqs running (vllm-ascend PR #5212, "
                "the variant behind its published result); one-short: while some rank has "
                "max_num_seqs - 1 or more (vllm-ascend PR #7611, reverted in #8675 after a "
                "first-token latency regression)", group="data parallel")
    # The gate reads only the maximum running count, so one integer all-reduced (MAX) gives the
    # decisions the gathered list does, for less (gloo's all-gather costs more: docs/BENCHMARKS.md).
    # The all-gather stays the default because it is vllm-ascend's.
    balance_count_sync: BalanceCountSync = flag(
        "all-gather", "how the balance gate learns the ranks' running counts: all-gather: every "
                      "rank's count, as vllm-ascend does; all-reduce-max: only the largest, the "
                      "same decisions for one integer", group="data parallel")
    # None: resolved by EngineConfig.resolve_async_scheduling once the model's device is known.
    async_scheduling: bool | None = flag(
        None, "schedule the next step while the forward of this one runs (vLLM's async "
              "scheduling with its batch queue); default: on CUDA, off on CPU, where it measured "
              "no faster (docs/BENCHMARKS.md)")

    def __post_init__(self):
        check_at_least(self, max_num_seqs=1, max_num_batched_tokens=1,
                       max_model_len=1 if self.max_model_len != -1 else -1,
                       long_prefill_token_threshold=0)
        check_choices(self)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) without chunked prefill, or long prompts could never run")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = flag(16, "tokens per KV cache block")
    # Set by the model runner from the memory it may use, before a Scheduler is built.
    num_blocks: int | None = field(default=None, metadata=RUNTIME)
    enable_prefix_caching: bool = flag(
        True, "reuse the KV cache blocks of a prompt prefix computed before")
    kv_cache_memory: int = flag(1 << 30, "KV cache bytes on CPU (4G: 4*2^30, 4g: 4*10^9)",
                                 type=human_readable_int)
    gpu_memory_utilization: float = flag(
        0.9, "the fraction of the GPU's memory the engine may use on CUDA; the KV cache gets what "
             "the profiling forward leaves over")
    def __post_init__(self):
        if (memory := self.kv_cache_memory) < 1:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {memory}")
        if not 0 < (fraction := self.gpu_memory_utilization) <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
        check_at_least(self, block_size=1)
        if (num_blocks := self.num_blocks) is not None and num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")


@dataclass(slots=True)
class ParallelConfig:
    data_parallel_size: int = flag(
        1, "number of engine replicas (DP ranks), on every machine together", aliases=("-dp",))
    data_parallel_rank: int = field(default=0, metadata=RUNTIME)
    # vLLM's flags, so that its command lines run: 1 is what minicore does, anything else is
    # refused (one model replica per process; data parallelism is its only parallelism).
    tensor_parallel_size: int = flag(
        1, "accepted as 1 only: minicore has no tensor parallelism", aliases=("-tp",))
    pipeline_parallel_size: int = flag(
        1, "accepted as 1 only: minicore has no pipeline parallelism", aliases=("-pp",))
    # vLLM's flag: mp starts processes (engine/launch.py), ray places actors (dp/ray_launch.py).
    data_parallel_backend: DataParallelBackend = flag(
        "mp", "how the DP ranks start: mp: processes on this machine, ranks on other machines "
              "with --headless; ray: Ray actors, placed on the nodes of a Ray cluster "
              "(RAY_ADDRESS, else a local one started here)", aliases=("-dpb",))
    # A frontend's local ranks start at 0; ranks on other machines start headless.
    data_parallel_size_local: int | None = flag(
        None, "DP ranks to start on this machine (default: all, from the start rank on)",
        aliases=("-dpl",))
    data_parallel_start_rank: int = flag(
        0, "the first DP rank started on this machine (with --headless)", aliases=("-dpr",))
    data_parallel_address: str | None = flag(  # None: set in __post_init__, or by Ray's placement
        None, "the frontend machine's address, which every rank connects to (default: 127.0.0.1; "
              "ray: this node's Ray address if a rank runs on another node)", aliases=("-dpa",))
    # Rank 0 hosts the torch.distributed rendezvous; the frontend listens for the engines of every
    # machine on the port after it.
    data_parallel_rpc_port: int = flag(
        29550, "the DP group's rendezvous port; the engines' handshake is on the next",
        aliases=("-dpp",))
    # vLLM's load-balancing modes (vllm/engine/arg_utils.py): a frontend per DP rank (external;
    # `serve --data-parallel-rank R` sets it) or per machine (hybrid: --data-parallel-start-rank
    # without --headless), each sending requests to its own ranks only; the waves stay in step
    # through a coordinator on rank 0's machine (WaveCoordinator, minicore/dp/client.py).
    data_parallel_external_lb: bool = flag(
        False, "a frontend per DP rank (set by --data-parallel-rank), its own port, an external "
               "load balancer in front; waves still coordinated from rank 0's machine")
    data_parallel_hybrid_lb: bool = flag(
        False, "a frontend per machine, balancing over that machine's DP ranks (inferred from "
               "--data-parallel-start-rank without --headless; rank 0's machine passes it)")
    # The clients an engine serves, from its handshake (vLLM's client_count): its API servers
    # and, with external or hybrid load balancing, the wave coordinator.
    client_count: int = field(default=1, metadata=RUNTIME)
    # vLLM's flag (vllm/engine/arg_utils.py). As in vLLM's DP deployments, the expert-parallel
    # group is the DP ranks themselves (minicore/model/expert_parallel.py).
    enable_expert_parallel: bool = flag(
        False, "shard every mixture-of-experts layer's experts over the DP ranks (expert "
               "parallelism): each rank holds 1/N of them, and every forward, dummy ones "
               "included, exchanges tokens with the other ranks; needs --data-parallel-size >= 2 "
               "and a Qwen3-MoE, Qwen2-MoE, Mixtral or OLMoE model")
    # vLLM's flag (vllm/config/parallel.py); minicore/dp/elastic_ep.py.
    enable_elastic_ep: bool = flag(
        False, "elastic expert parallelism: POST /scale_elastic_ep grows or shrinks the DP group "
               "while it serves; needs --data-parallel-backend ray and --enable-expert-parallel")
    # vLLM's flag, the hook RL frameworks (verl, OpenRLHF) sync weights through.
    worker_extension_cls: str = flag(
        "", "a class, 'package.module.Class', whose methods join the model runner's, each "
            "callable by name through collective_rpc, as vLLM's worker extension (the runner is "
            "the worker here, and its model_runner too)")

    def __post_init__(self):
        if self.worker_extension_cls and "." not in self.worker_extension_cls:
            raise ValueError("worker_extension_cls must name a class with its module, "
                             f"'package.module.Class', got {self.worker_extension_cls!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} {getattr(self, name)} is not supported by minicore: "
                                 "only 1 (scale out with --data-parallel-size)")
        check_at_least(self, data_parallel_size=1)
        if self.data_parallel_external_lb or self.data_parallel_hybrid_lb:
            self._resolve_load_balancing()
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = self.data_parallel_size - self.data_parallel_start_rank
        if self.data_parallel_backend == "ray":
            self._check_ray()
        elif self.data_parallel_backend != "mp":
            raise ValueError(f"data_parallel_backend {self.data_parallel_backend!r}: mp or ray")
        elif self.data_parallel_address is None:
            self.data_parallel_address = "127.0.0.1"
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
        if self.enable_elastic_ep and not (self.data_parallel_backend == "ray"
                                           and self.enable_expert_parallel):
            raise ValueError("--enable-elastic-ep needs --data-parallel-backend ray and "
                             "--enable-expert-parallel (vLLM's elastic EP runs on Ray)")

    def _check_ray(self) -> None:
        # Rank 0 hosts the DP group's rendezvous at the frontend's address, so it runs beside it.
        if (self.data_parallel_size < 2 or self.data_parallel_start_rank
                or self.data_parallel_size_local < 1):
            raise ValueError("--data-parallel-backend ray needs --data-parallel-size >= 2, ranks "
                             "0 to --data-parallel-size-local - 1 (at least rank 0) on the "
                             "frontend's node, no --data-parallel-start-rank; Ray places the rest")

    def _resolve_load_balancing(self) -> None:
        """vLLM's rules (EngineArgs.create_engine_config): external load balancing runs one rank
        here; hybrid needs --data-parallel-size-local, and with one local rank is external."""
        if self.data_parallel_external_lb and self.data_parallel_hybrid_lb:
            raise ValueError("`--data-parallel-hybrid-lb` and `--data-parallel-external-lb` cannot "
                             "be enabled together. Enable only one load-balancing mode.")
        if self.data_parallel_size < 2 or self.data_parallel_backend != "mp":
            raise ValueError("external and hybrid load balancing need --data-parallel-size >= 2 "
                             "and the mp backend")
        if self.data_parallel_external_lb:
            if self.data_parallel_size_local not in (1, None):
                raise ValueError("an external data-parallel rank requires "
                                 "`--data-parallel-size-local 1`; got "
                                 f"{self.data_parallel_size_local}. Set it to 1 or omit it.")
            self.data_parallel_size_local = 1
        elif self.data_parallel_size_local is None:
            raise ValueError("`--data-parallel-hybrid-lb` requires `--data-parallel-size-local`. "
                             "Set it to the number of data-parallel ranks on this node.")
        elif self.data_parallel_size_local == 1:
            self.data_parallel_hybrid_lb, self.data_parallel_external_lb = False, True
        elif self.data_parallel_size_local == self.data_parallel_size:
            self.data_parallel_hybrid_lb = False  # one machine: internal load balancing

    @property
    def engine_ranks(self) -> range:
        """The ranks a frontend here sends requests to: all, or with external or hybrid load
        balancing, this machine's."""
        balanced_here = self.data_parallel_external_lb or self.data_parallel_hybrid_lb
        return self.local_ranks if balanced_here else range(self.data_parallel_size)

    @property
    def local_ranks(self) -> range:
        return range(self.data_parallel_start_rank,
                     self.data_parallel_start_rank + self.data_parallel_size_local)


def rank_span(ranks: range) -> str:
    """DP ranks as an interval, for messages: [0, 4)."""
    return f"[{ranks.start}, {ranks.stop})"


@dataclass(slots=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    # Prefill/decode disaggregation's settings, kept in their own record (vLLM: VllmConfig's).
    kv_transfer_config: KVTransferConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)

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
        if self.speculative_config is not None and not runner_info(runner).has_logits:
            raise ValueError(f"the {runner} runner has no model to verify drafts against: "
                             "--speculative-config needs --runner transformers")
        spec, max_len = self.speculative_config, self.scheduler_config.max_model_len
        if spec is not None and 0 < max_len <= (drafts := spec.num_speculative_tokens):
            raise ValueError(f"speculative_config: num_speculative_tokens ({drafts}) must be less "
                             f"than max_model_len ({max_len})")
        if self.scheduler_config.async_scheduling and (reason := self._async_unsupported()):
            raise ValueError(f"--async-scheduling does not support {reason}")

    def _async_unsupported(self) -> str | None:
        """What in this config async scheduling cannot run with."""
        if (self.parallel_config.data_parallel_size > 1
                and runner_info(self.model_config.runner).reports_step_time):
            return (f"the {self.model_config.runner} runner with --data-parallel-size > 1 (its "
                    "lockstep forwards)")
        return None

    def resolve_async_scheduling(self, device_type: str) -> bool:
        """--async-scheduling's default, once the runner's device is known: on for CUDA (vLLM's
        default), off on CPU (measured no faster there: docs/BENCHMARKS.md), and off where
        unsupported."""
        sc = self.scheduler_config
        if sc.async_scheduling is None:
            sc.async_scheduling = device_type == "cuda" and self._async_unsupported() is None
        return sc.async_scheduling


# EngineConfig's sub-configs, with the titles of their flags' --help groups.
SUB_CONFIGS = (("model_config", ModelConfig, "model"),
                ("scheduler_config", SchedulerConfig, "scheduler"),
                ("cache_config", CacheConfig, "cache"),
                ("parallel_config", ParallelConfig, "data parallel"),
                ("observability_config", ObservabilityConfig, "observability"))


def create_engine_config(**kwargs) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (vLLM's EngineArgs names), each routed to
    the sub-config that has a field of that name. scheduling_policy is vLLM's name for policy;
    reasoning_parser goes into structured_outputs_config, as vLLM's."""
    if "scheduling_policy" in kwargs:
        kwargs["policy"] = kwargs.pop("scheduling_policy")
    parts = {"kv_transfer_config": kwargs.pop("kv_transfer_config", None)}
    if (speculative := kwargs.pop("speculative_config", None)) is not None:
        parts["speculative_config"] = config_record(SpeculativeConfig, speculative,
                                                    "speculative_config")
    structured = config_record(StructuredOutputsConfig,
                               kwargs.pop("structured_outputs_config", None) or {},
                               "structured_outputs_config")
    if reasoning_parser := kwargs.pop("reasoning_parser", None):  # vLLM's EngineArgs sets it so
        structured = replace(structured, reasoning_parser=reasoning_parser)
    parts["structured_outputs_config"] = structured
    for name, cls, _ in SUB_CONFIGS:
        names = {f.name for f in fields(cls)}
        parts[name] = cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    if kwargs:
        raise TypeError(f"unknown engine argument(s): {', '.join(sorted(kwargs))}")
    return EngineConfig(**parts)
