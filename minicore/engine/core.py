"""EngineCore: the scheduler and the model runner, driven one step at a time or two at once.

Mirrors EngineCore in vllm/v1/engine/core.py: add_request, abort_requests, and its two step
functions, bound once as step_fn: step() schedules, runs the model and updates the scheduler with
what it sampled; with async scheduling, step_with_batch_queue() schedules and submits step N+1 to
the forward thread while step N runs, and only then waits for N (the scheduler's placeholders:
minicore/scheduler/async_scheduler.py). A KV connector is bound once, by bind_kv_connectors
(minicore/kv_transfer/worker.py): its scheduler side goes to the Scheduler, its worker side wraps
the runner's forward. It then keeps stepping while the scheduler holds blocks for a peer or waits
for remote KV, even with nothing to compute (Scheduler.has_requests). With --speculative-config a
drafter (minicore/spec_decode/drafter.py) proposes each request's drafts after the update, which the
scheduler takes; the structured output manager (minicore/structured_output/manager.py) takes each
request's grammar at add_request. The utility methods (sleep, pause, collective_rpc, ...) are
EngineControl's (minicore/engine/control.py). Left out: pipeline parallelism's deeper batch queue,
the executor layer (one in-process runner on one thread), LoRA.
"""

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from minicore.config import EngineConfig
from minicore.engine.control import EngineControl
from minicore.engine.input_processor import validate_prompt_token_ids, validate_sampling_params
from minicore.kv_transfer.base import KVConnectorBase_V1
from minicore.kv_transfer.worker import bind_kv_connectors
from minicore.model.registry import runner_info
from minicore.model.runner_base import ModelRunnerInterface
from minicore.protocol import EngineCoreOutput
from minicore.request import Request, RequestStatus
from minicore.scheduler import BalanceScheduler, Scheduler, SchedulerOutput
from minicore.scheduler.structured_output import NO_STRUCTURED_OUTPUT
from minicore.spec_decode.drafter import make_drafter
from minicore.structured_output.manager import make_structured_output_manager

logger = logging.getLogger(__name__)


class EngineCore(EngineControl):
    def __init__(self, config: EngineConfig, model=None, tokenizer=None):
        """model/tokenizer: an already loaded transformers model and its tokenizer; by default
        they are loaded from config.model_config. A runner that needs no weights (the simulated
        one, minicore/model/registry.py) loads no model (nor imports torch)."""
        self.config = config
        self.runner_info = runner_info(config.model_config.runner)
        self.model_runner: ModelRunnerInterface = self._make_model_runner(config, model, tokenizer)
        # A runner without a device (the simulated one) counts as a CPU one.
        async_scheduling = config.resolve_async_scheduling(
            getattr(getattr(self.model_runner, "device", None), "type", "cpu"))
        # The one place num_blocks is set at run time: the runner has sized the KV cache.
        config.cache_config.num_blocks = self.model_runner.num_blocks
        _check_kv_cache_fits(config)
        self.kv_connectors = bind_kv_connectors(config, self.model_runner)
        self.execute_model = self.kv_connectors.execute_model
        # Compiles grammars off the loop, masks and advances them (structured outputs).
        self.structured_output_manager = make_structured_output_manager(
            config, self.model_runner, self.runner_info.has_logits)
        self.scheduler = make_scheduler(config, self.kv_connectors.scheduler_side,
                                        self.structured_output_manager.scheduler_side)
        # Proposes each request's drafts after a step (NoDrafter without --speculative-config).
        self.drafter = make_drafter(config)
        # The forward's one thread, started on first use: the model's thread-local state stays put.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="EngineCore-forward")
        # Steps submitted and not yet updated from, newest first (vLLM: batch_queue).
        self.batch_queue: deque[tuple[Future, SchedulerOutput]] = deque()
        self.batch_queue_size = 2 if async_scheduling else 1
        self.step_fn = self.step_with_batch_queue if async_scheduling else self.step

    def _make_model_runner(self, config: EngineConfig, model, tokenizer):
        runner_cls = self.runner_info.load_class()
        if not self.runner_info.needs_weights:
            return runner_cls(config)
        if model is None:
            model, tokenizer = self._load_model(config)
        return runner_cls(config, model, tokenizer)

    def _load_model(self, config: EngineConfig):
        """(model, tokenizer) from config.model_config, ready for the runner, whose first forward
        may run at once (DPEngineCoreProc shards an MoE model's experts here)."""
        from minicore.model.loader import load_model

        mc = config.model_config
        return load_model(mc.model, dtype=mc.dtype, device=mc.device, tokenizer=mc.tokenizer)

    def add_request(self, request: Request) -> None:
        """ValueError for a request the model cannot run; nothing is scheduled then."""
        validate_prompt_token_ids(request.prompt_token_ids, self.model_runner.vocab_size,
                                  self.config.scheduler_config.max_model_len)
        validate_sampling_params(request.sampling_params, self.model_runner.vocab_size,
                                 self.config.model_config.max_logprobs,
                                 self.runner_info.has_logits)
        self.scheduler.remote_kv.validate_request(request)
        self.structured_output_manager.grammar_init(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """Schedule, execute and update once. Returns the outputs and whether the model ran."""
        if not self.scheduler.has_requests():
            return [], False
        scheduler_output = self.scheduler.schedule()
        model_output = self.execute_model(scheduler_output)
        outputs = self.update_from_output(scheduler_output, model_output)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def step_with_batch_queue(self) -> tuple[list[EngineCoreOutput], bool]:
        """Schedule and submit the next step while the one before runs; then wait for the oldest
        step and update from it. Returns its outputs ([] if none was waited for) and whether the
        new step runs the model."""
        executed = self._submit_next_batch()
        if (batch := self._batch_to_finish(executed)) is None:
            return [], executed
        future, scheduler_output = batch
        return self.update_from_output(scheduler_output, future.result()), executed

    def _submit_next_batch(self) -> bool:
        """Schedule a step and hand it to the forward thread; whether it runs the model."""
        if not self.scheduler.has_requests():
            return False
        scheduler_output = self.scheduler.schedule()
        future = self.executor.submit(self.execute_model, scheduler_output)
        self.batch_queue.appendleft((future, scheduler_output))
        return scheduler_output.total_num_scheduled_tokens > 0

    def _batch_to_finish(self, executed: bool) -> tuple[Future, SchedulerOutput] | None:
        """The oldest step, to wait for now; None while the queue has room and the oldest still
        runs after a step that runs the model went in (vLLM's rule)."""
        queue = self.batch_queue
        if not queue or (executed and len(queue) < self.batch_queue_size
                         and not queue[-1][0].done()):
            return None
        return queue.pop()

    def update_from_output(self, scheduler_output, model_output) -> list[EngineCoreOutput]:
        """The scheduler's update, then the drafts of the next step (vLLM: post_step)."""
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.scheduler.update_draft_token_ids(self.drafter.propose(
            self.scheduler.requests, len(self.scheduler.running), scheduler_output))
        return outputs

    def execute_dummy_batch(self) -> None:
        self.model_runner.execute_dummy_batch()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.structured_output_manager.shutdown()
        self.kv_connectors.shutdown()


def make_scheduler(config: EngineConfig, connector: KVConnectorBase_V1 | None = None,
                   structured_output_manager=NO_STRUCTURED_OUTPUT) -> Scheduler:
    cls, gate = ((BalanceScheduler, {"dp_size": config.parallel_config.data_parallel_size})
                 if config.scheduler_config.balance_scheduling else (Scheduler, {}))
    return cls(config.scheduler_config, config.cache_config, connector,
               config.speculative_config, structured_output_manager, **gate)


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
