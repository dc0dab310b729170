"""The worker side of a KV connector around one forward.

Mirrors KVConnectorModelRunnerMixin in vllm/v1/worker/kv_connector_model_runner_mixin.py
(_get_kv_connector_output and kv_connector_no_forward): bind the step's connector metadata, start
its loads, run the forward, wait for saves, collect what finished, clear the metadata. An empty
step (nothing scheduled, as on an instance that only holds blocks for a peer) still runs all of it
but the forward, so transfers are polled. EngineCore calls this in place of the runner's
execute_model when it has a connector, so the runners themselves know nothing of connectors;
bind_kv_connectors makes that choice once, when the engine is built (vLLM: the scheduler's side in
Scheduler.__init__, the worker's in the model runner). Left out: layer-wise loads and saves,
connector stats.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from minicore.config import EngineConfig
from minicore.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from minicore.kv_transfer.factory import KVConnectorFactory
from minicore.model.runner_base import ModelRunnerInterface
from minicore.scheduler.output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True)
class KVConnectors:
    """An engine's KV connector, bound once: its two sides (None without one) and the forward
    the engine runs each step."""
    scheduler_side: KVConnectorBase_V1 | None
    worker_side: KVConnectorBase_V1 | None
    execute_model: Callable[[SchedulerOutput], ModelRunnerOutput]

    def shutdown(self) -> None:
        for side in (self.worker_side, self.scheduler_side):
            if side is not None:
                side.shutdown()


def bind_kv_connectors(config: EngineConfig, runner: ModelRunnerInterface) -> KVConnectors:
    """The configured connector's two sides, the worker's given the runner's KV cache (the
    simulated runner has none) and wrapped around its forward; without kv_transfer_config, the
    runner's own forward, so that an engine without a connector pays nothing per step."""
    if config.kv_transfer_config is None:
        return KVConnectors(None, None, runner.execute_model)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)
    if (kv_caches := getattr(runner, "kv_caches", None)) is not None:
        worker.register_kv_caches(kv_caches)
    scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER)
    return KVConnectors(scheduler, worker, partial(execute_model_with_kv_connector, runner, worker))


def execute_model_with_kv_connector(runner: ModelRunnerInterface, connector: KVConnectorBase_V1,
                                    scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    try:
        connector.start_load_kv()
        output = runner.execute_model(scheduler_output)
        connector.wait_for_save()
        finished_sending, finished_recving = connector.get_finished(
            scheduler_output.finished_req_ids)
        invalid_block_ids = connector.get_block_ids_with_load_errors()
    finally:
        connector.clear_connector_metadata()
    # A new record (runners may hand back a shared empty output), with all the runner's fields:
    # its logprobs included.
    return replace(output, kv_connector_output=KVConnectorOutput(
        finished_sending, finished_recving, invalid_block_ids))
