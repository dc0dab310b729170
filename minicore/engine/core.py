"""EngineCore: the scheduler and the model runner, driven one step at a time or two at once.

Mirrors EngineCore in vllm/v1/engine/core.py: add_request, abort_requests, and its two step
functions, bound once as step_fn: step() schedules, runs the model and updates the scheduler with
what it sampled; with async scheduling, step_with_batch_queue() schedules and submits step N+1 to
the forward thread while step N runs, and only then waits for N (the scheduler's placeholders:
minicore/scheduler/async_scheduler.py). What it runs with comes built, as EngineComponents, from
the composition root (minicore/engine/components.py), as vLLM's EngineCore takes the executor
class chosen for it: the runner, whose forward a KV connector's worker side wraps (execute_model),
the scheduler with its components, the checks a request passes before it is scheduled (the
structured output manager takes its grammar there), and the drafter, which proposes each request's
drafts after the update for the scheduler to take. With a KV connector the engine keeps stepping
while the scheduler holds blocks for a peer or waits for remote KV, even with nothing to compute
(Scheduler.has_requests). The utility methods (sleep, pause, collective_rpc, ...) are
EngineControl's (minicore/engine/control.py). Left out: pipeline parallelism's deeper batch queue,
the executor layer (one in-process runner on one thread), LoRA.
"""

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from minicore.engine.control import EngineControl
from minicore.protocol import EngineCoreOutput
from minicore.request import Request, RequestStatus

if TYPE_CHECKING:
    from minicore.config import EngineConfig
    from minicore.engine.components import EngineComponents

logger = logging.getLogger(__name__)


class EngineCore(EngineControl):
    def __init__(self, config: "EngineConfig", components: "EngineComponents"):
        """components: build_components(config, ...) of minicore/engine/components.py."""
        self.config = config
        self.runner_info = components.runner_info
        self.model_runner = components.model_runner
        self.kv_connectors = components.kv_connectors
        self.execute_model = components.kv_connectors.execute_model
        self.structured_output_manager = components.structured_output_manager
        self.scheduler = components.scheduler
        self.drafter = components.drafter
        self.elastic_ep = components.elastic_ep
        self._check_request = components.check_request
        # The forward's one thread, started on first use: the model's thread-local state stays put.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="EngineCore-forward")
        # Steps submitted and not yet updated from (vLLM: batch_queue).
        self.batch_queue = components.batch_queue
        self.step_fn = self.step_with_batch_queue if self.batch_queue.size > 1 else self.step
        components.step_tracer.bind(self)  # --trace-steps' wraps of the forward and the shutdown

    def add_request(self, request: Request) -> None:
        """ValueError for a request the model cannot run; nothing is scheduled then."""
        self._check_request(request)
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
        if (batch := self.batch_queue.take_finished(executed)) is None:
            return [], executed
        future, scheduler_output = batch
        return self.update_from_output(scheduler_output, future.result()), executed

    def _submit_next_batch(self) -> bool:
        """Schedule a step and hand it to the forward thread; whether it runs the model."""
        if not self.scheduler.has_requests():
            return False
        scheduler_output = self.scheduler.schedule()
        future = self.executor.submit(self.execute_model, scheduler_output)
        self.batch_queue.push(future, scheduler_output)
        return scheduler_output.total_num_scheduled_tokens > 0

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
