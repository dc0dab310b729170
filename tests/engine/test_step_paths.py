"""The two step paths cannot drift apart. EngineCore.step and step_with_batch_queue (the offline
LLM's, called in a plain loop) and EngineCoreProc's awaited twins (_process_engine_step,
_process_batch_queue_step: the busy loop's, which awaits the forward thread instead of blocking on
it) must make the same schedules and the same outputs from the same requests. Both are driven here
in one process on the simulated runner, with chunked prefills, a preemption and max_tokens caps,
in each mode; every SchedulerOutput and every output is compared."""

import asyncio

import pytest

from minicore.config import create_engine_config
from minicore.engine.components import build_components, make_engine_core
from minicore.engine.core import EngineCore
from minicore.engine.core_proc import EngineCoreProc
from minicore.testing import make_request


def requests():
    return [make_request(f"r{i}", list(range(100 * i, 100 * i + 3 + 5 * i)), max_tokens=3 + 2 * i)
            for i in range(6)]


def config(async_scheduling: bool):
    # A tight budget and KV cache: chunked prefills, and preemptions once the decodes grow.
    return create_engine_config(runner="simulated", async_scheduling=async_scheduling,
                                max_model_len=48, max_num_batched_tokens=16, block_size=4,
                                num_blocks=14)


def record(engine: EngineCore) -> list:
    """Each SchedulerOutput's scheduled tokens, preemptions and finishes, as they are made."""
    schedules, schedule = [], engine.scheduler.schedule

    def recorded():
        out = schedule()
        schedules.append((dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids),
                          sorted(out.finished_req_ids)))
        return out

    engine.scheduler.schedule = recorded
    return schedules


def outputs_of(outputs) -> list:
    return [(o.request_id, list(o.new_token_ids), o.finish_reason) for o in outputs]


def run_offline(async_scheduling: bool) -> tuple[list, list]:
    engine = make_engine_core(config(async_scheduling))
    schedules, outputs = record(engine), []
    for request in requests():
        engine.add_request(request)
    try:
        while engine.scheduler.has_requests() or engine.batch_queue.has_pending():
            step_outputs, _ = engine.step_fn()
            outputs.append(outputs_of(step_outputs))
    finally:
        engine.shutdown()
    return schedules, [o for o in outputs if o]


def run_busy_loop_steps(async_scheduling: bool) -> tuple[list, list]:
    """EngineCoreProc's step coroutines on an engine built without sockets (EngineCore's own
    construction): what they send is what they would send to the frontend."""
    engine = EngineCoreProc.__new__(EngineCoreProc)
    c = config(async_scheduling)
    EngineCore.__init__(engine, c, build_components(c))
    schedules, outputs = record(engine), []
    engine._send = lambda step_outputs=None, **_: outputs.append(outputs_of(step_outputs or []))
    step = (engine._process_batch_queue_step if engine.batch_queue.size > 1
            else engine._process_engine_step)
    for request in requests():
        engine.add_request(request)

    async def loop():
        # run_busy_loop steps again while there is work (after a step that ran no model, once
        # KV_POLL_INTERVAL_S has passed without input): here no input comes.
        while engine.has_work():
            await step()

    try:
        asyncio.run(loop())
    finally:
        engine.shutdown()
    return schedules, [o for o in outputs if o]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["step", "batch-queue"])
def test_the_busy_loop_steps_as_the_offline_loop_does(async_scheduling):
    offline_schedules, offline_outputs = run_offline(async_scheduling)
    served_schedules, served_outputs = run_busy_loop_steps(async_scheduling)
    assert any(preempted for _, preempted, _ in offline_schedules), "no preemption happened"
    # r5's 28 prompt tokens went in chunks.
    assert next(s["r5"] for s, _, _ in offline_schedules if "r5" in s) < 28
    finished = {o[0] for step in offline_outputs for o in step if o[2] is not None}
    assert finished == {f"r{i}" for i in range(6)}
    assert served_schedules == offline_schedules
    assert served_outputs == offline_outputs
