"""The composition root: from an EngineConfig, every component the engine core runs with.

The one place that reads a feature's config and picks its component: the model runner (by
--runner, minicore/model/registry.py), the KV connectors' two sides, the structured output
manager, the scheduler's own components (drafts, async scheduling's placeholders, logprobs, the
balance gate), the drafter, the step function's batch queue and the step tracer. EngineCore
(minicore/engine/core.py) takes the result and imports none of these packages; a new feature adds
its files and a line here, not a parameter to the core's constructors. vLLM makes the same split
at one level: EngineCore takes the executor class that Executor.get_class(vllm_config) chose
(vllm/v1/executor/abstract.py). For a DP rank (dp_group given) the root also checks the rank's
config against its peers' and shards an MoE model's experts over the ranks before the runner
exists.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from minicore.config import CacheConfig, EngineConfig, SchedulerConfig
from minicore.engine.batch_queue import BatchQueue
from minicore.engine.client_router import ClientRouter, OneClient, make_client_router
from minicore.engine.core import EngineCore
from minicore.engine.input_processor import validate_prompt_token_ids, validate_sampling_params
from minicore.kv_transfer.base import KVConnectorBase_V1
from minicore.kv_transfer.worker import KVConnectors, bind_kv_connectors
from minicore.model.registry import RunnerInfo, runner_info
from minicore.model.runner_base import ModelRunnerInterface
from minicore.request import Request
from minicore.scheduler import Scheduler
from minicore.scheduler.async_scheduler import OutputPlaceholders
from minicore.scheduler.balance import BalanceScheduler
from minicore.scheduler.interfaces import NO_STRUCTURED_OUTPUT
from minicore.scheduler.logprobs import Logprobs
from minicore.scheduler.spec_decode import RunnerDrafts, SpecDecode
from minicore.spec_decode.config import SpeculativeConfig
from minicore.spec_decode.drafter import Drafter, NoDrafter, make_drafter
from minicore.structured_output.manager import make_structured_output_manager
from minicore.tracing.step_tracer import NoStepTracer, make_step_tracer


@dataclass(slots=True)
class EngineComponents:
    """What EngineCore runs with: each a do-nothing default where its feature is off."""
    runner_info: RunnerInfo
    model_runner: ModelRunnerInterface
    kv_connectors: KVConnectors
    # Compiles grammars off the loop, masks and advances them (RefusedStructuredOutput where
    # structured outputs cannot run).
    structured_output_manager: object
    scheduler: Scheduler
    # Proposes each request's drafts after a step (NoDrafter without --speculative-config).
    drafter: Drafter
    # Of size 2 with async scheduling (a step runs while the next is scheduled), else 1.
    batch_queue: BatchQueue
    # Raises ValueError for a request the model cannot run, before it is scheduled.
    check_request: Callable[[Request], None]
    # An engine process's frontends: OneClient, or with several API servers a ClientRouter.
    client_router: OneClient | ClientRouter
    # Re-forms a DP rank's group at another size: ElasticEP (--enable-elastic-ep) or NoElasticEP.
    elastic_ep: object
    # Writes the steps to --trace-steps (StepTracer: it wraps the scheduler, the runner's dummy
    # batch and the DP group here, and the engine in EngineCore.__init__), or NoStepTracer.
    step_tracer: NoStepTracer


def build_components(config: EngineConfig, model=None, tokenizer=None,
                     dp_group=None) -> EngineComponents:
    """model/tokenizer: an already loaded transformers model and its tokenizer; by default they
    are loaded from config.model_config (a runner that needs no weights, the simulated one, loads
    neither, nor imports torch). dp_group: a DP rank's DPGroup (minicore/dp/group.py)."""
    prepare_model = _prepare_dp_rank(config, dp_group) if dp_group is not None else None
    info = runner_info(config.model_config.runner)
    model_runner = _make_model_runner(config, info, model, tokenizer, prepare_model)
    async_scheduling = config.scheduler_config.async_scheduling
    # The one place num_blocks is set at run time: the runner has sized the KV cache.
    config.cache_config.num_blocks = model_runner.num_blocks
    _check_kv_cache_fits(config)
    kv_connectors = bind_kv_connectors(config, model_runner)
    so_manager = make_structured_output_manager(config, model_runner, info.has_logits)
    scheduler = make_scheduler(
        config.scheduler_config, config.cache_config, config.speculative_config,
        dp_size=config.parallel_config.data_parallel_size, has_logits=info.has_logits,
        connector=kv_connectors.scheduler_side, structured_output_manager=so_manager.scheduler_side)

    def check_request(request: Request) -> None:
        validate_prompt_token_ids(request.prompt_token_ids, model_runner.vocab_size,
                                  config.scheduler_config.max_model_len)
        validate_sampling_params(request.sampling_params, model_runner.vocab_size,
                                 config.model_config.max_logprobs, info.has_logits)
        scheduler.remote_kv.validate_request(request)
        so_manager.grammar_init(request)

    # With async scheduling the runner proposes the drafts itself, right after it samples.
    drafter = NoDrafter() if async_scheduling else make_drafter(config, model_runner)
    return EngineComponents(info, model_runner, kv_connectors, so_manager, scheduler, drafter,
                            BatchQueue(2 if async_scheduling else 1), check_request,
                            make_client_router(config.parallel_config.client_count),
                            _make_elastic_ep(config),
                            make_step_tracer(config, scheduler, model_runner, dp_group))


class NoElasticEP:
    """Elastic EP off: a rank refuses to re-form its group."""

    def reinitialize(self, engine, *args):
        raise ValueError("elastic EP is off: serve with --enable-elastic-ep")


def _make_elastic_ep(config: EngineConfig):
    if not config.parallel_config.enable_elastic_ep:
        return NoElasticEP()
    from minicore.dp.elastic_ep import ElasticEP  # Ray and torch.distributed: only with it

    return ElasticEP()


def make_engine_core(config: EngineConfig, model=None, tokenizer=None) -> EngineCore:
    """An in-process EngineCore (the offline LLM's), with the components config chooses."""
    return EngineCore(config, build_components(config, model, tokenizer))


def make_scheduler(scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                   speculative_config: SpeculativeConfig | None = None, *, dp_size: int = 1,
                   has_logits: bool = False, connector: KVConnectorBase_V1 | None = None,
                   structured_output_manager=NO_STRUCTURED_OUTPUT) -> Scheduler:
    """The scheduler (BalanceScheduler with the balance gate) with its components."""
    cls, gate = ((BalanceScheduler, {"dp_size": dp_size})
                 if scheduler_config.balance_scheduling else (Scheduler, {}))
    return cls(scheduler_config, cache_config, connector, structured_output_manager,
               **scheduler_components(scheduler_config, speculative_config, has_logits), **gate)


def scheduler_components(scheduler_config: SchedulerConfig,
                         speculative_config: SpeculativeConfig | None, has_logits: bool) -> dict:
    """The Scheduler's keyword arguments for the features that are on: drafts' bookkeeping, async
    scheduling's placeholders and, for a runner with logits, logprobs (its defaults do
    nothing)."""
    components: dict = {"logprobs": Logprobs()} if has_logits else {}
    async_scheduling = scheduler_config.async_scheduling
    if speculative_config is not None:
        spec_decode = RunnerDrafts if async_scheduling else SpecDecode
        components["spec_decode"] = spec_decode(speculative_config.num_speculative_tokens,
                                                speculative_config.num_lookahead_tokens,
                                                speculative_config.use_eagle())
    if async_scheduling:
        drafts = ((speculative_config.num_speculative_tokens,
                   speculative_config.disable_by_batch_size) if speculative_config else ())
        components["placeholders"] = OutputPlaceholders(scheduler_config.max_model_len, *drafts)
    return components


def load_model(config: EngineConfig):
    """(model, tokenizer) from config.model_config."""
    from minicore.model.loader import load_model

    mc = config.model_config
    return load_model(mc.model, dtype=mc.dtype, device=mc.device, tokenizer=mc.tokenizer)


def _make_model_runner(config: EngineConfig, info: RunnerInfo, model, tokenizer, prepare_model):
    """The runner, async scheduling's default resolved first (its sampling step depends on it):
    from the model's device; a runner without weights (the simulated one) counts as a CPU one."""
    runner_cls = with_worker_extension(info.load_class(),
                                       config.parallel_config.worker_extension_cls)
    if not info.needs_weights:
        config.resolve_async_scheduling("cpu")
        return runner_cls(config)
    if model is None:
        model, tokenizer = load_model(config)
    if prepare_model is not None:
        # Before the runner exists: on CUDA its profiling forward already meets the peers.
        model = prepare_model(model)
    config.resolve_async_scheduling(next(model.parameters()).device.type)
    return runner_cls(config, model, tokenizer)


def with_worker_extension(runner_cls: type, qualified_name: str) -> type:
    """runner_cls with the methods of the class qualified_name names mixed in (vLLM's
    worker_extension_cls, which extends its Worker class the same way), or runner_cls itself
    without one. ValueError for a class that cannot be imported, or that would replace a
    runner's attribute."""
    if not qualified_name:
        return runner_cls
    module_name, _, class_name = qualified_name.rpartition(".")
    try:
        extension = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker_extension_cls {qualified_name!r} could not be imported: "
                         f"{e}") from None
    if clashes := sorted(name for name in vars(extension)
                         if not name.startswith("__") and hasattr(runner_cls, name)):
        raise ValueError(f"worker_extension_cls {qualified_name!r} would replace the runner's "
                         f"{', '.join(clashes)}")
    # vLLM's extensions reach the runner as self.model_runner: here the worker is the runner.
    return type(f"{runner_cls.__name__}With{class_name}", (runner_cls, extension),
                {"model_runner": property(lambda self: self)})


def _prepare_dp_rank(config: EngineConfig, dp_group):
    """A DP rank's first steps together, before its model loads: its config checked against its
    peers' (ranks that differ would hang, or garble, what follows), then, with expert
    parallelism, the expert-parallel group made; returns how to prepare the loaded model."""
    # Imported here: a single engine needs neither torch.distributed nor the fingerprint.
    from minicore.dp.fingerprint import check_dp_ranks_agree
    from minicore.model.expert_parallel import make_expert_sharder

    check_dp_ranks_agree(config, dp_group.all_gather_json)
    return make_expert_sharder(config, dp_group.new_expert_parallel_group,
                               config.parallel_config.data_parallel_rank)


def _check_kv_cache_fits(config: EngineConfig) -> None:
    """A cache that cannot hold one request of max_model_len would preempt such a request
    forever."""
    num_blocks, block_size = config.cache_config.num_blocks, config.cache_config.block_size
    max_model_len = config.scheduler_config.max_model_len
    needed = -(-max_model_len // block_size) + 1
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks, but one request of max_model_len "
            f"({max_model_len}) tokens needs {needed} (with the reserved null block); give the "
            "cache more memory or lower max_model_len")

