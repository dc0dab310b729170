"""The scheduler's KV connector paths, with NixlConnector's real scheduler side and no NIXL (as
vLLM's tests/v1/kv_connector/unit): a prefill instance and a decode instance, each a Scheduler,
the worker sides played by the test. Every path ends with no request left and every block back in
the free queue. Also the prefill side's deadline freeing held blocks through EngineCore steps
with nothing else to do, and the connector modules' purity."""

import subprocess
import sys
import time

import pytest

from minicore.config import CacheConfig, EngineConfig, SchedulerConfig, create_engine_config
from minicore.engine.components import make_engine_core, scheduler_components
from minicore.engine.core import EngineCore
from minicore.kv_transfer.base import KVConnectorRole
from minicore.kv_transfer.config import KVTransferConfig
from minicore.kv_transfer.nixl import NixlConnector
from minicore.request import FinishReason, RequestStatus
from minicore.scheduler import Scheduler
from minicore.scheduler.output import KVConnectorOutput
from minicore.testing import (
    fake_model_output,
    finish_step,
    make_request,
    num_free,
    schedule_step,
    step,
)

BLOCK_SIZE, NUM_BLOCKS = 4, 32


def make_pd_scheduler(engine_id: str, kv_load_failure_policy: str = "recompute",
                      async_scheduling: bool = False) -> Scheduler:
    config = EngineConfig(
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        kv_transfer_config=KVTransferConfig("NixlConnector", "kv_both", engine_id,
                                            {"side_channel_port": 7000},
                                            kv_load_failure_policy=kv_load_failure_policy))
    connector = NixlConnector(config, KVConnectorRole.SCHEDULER)
    scheduler_config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64,
                                       async_scheduling=async_scheduling)
    return Scheduler(scheduler_config, config.cache_config, connector,
                     **scheduler_components(scheduler_config, None, has_logits=True))


def assert_empty(s: Scheduler) -> None:
    # has_requests() stays true until a step has told the runner of the finished ids.
    assert not s.requests and not s.remote_kv.has_pending_requests()
    assert num_free(s) == NUM_BLOCKS - 1


def prefill(p: Scheduler, prompt: list[int], req_id: str = "r"):
    """Run the prefill instance's request (max_tokens=1); return its kv_transfer_params."""
    p.add_request(make_request(req_id, prompt, max_tokens=1,
                               kv_transfer_params={"do_remote_decode": True}))
    outputs = step(p).outputs
    assert outputs[0].finish_reason == FinishReason.LENGTH
    return outputs[0].kv_transfer_params


def report(s: Scheduler, **kv_output) -> list:
    """A step whose worker side reports kv_output; returns the engine outputs."""
    out = s.schedule()
    runner_output = fake_model_output(s, out)
    runner_output.kv_connector_output = KVConnectorOutput(**kv_output)
    return s.update_from_output(out, runner_output)


def test_remote_prefill_then_remote_decode():
    p, d = make_pd_scheduler("P"), make_pd_scheduler("D")
    prompt = list(range(100, 110))  # 10 tokens: 3 blocks of 4
    params = prefill(p, prompt)
    held = p.kv_cache_manager.get_block_ids("r")
    assert params == dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=held,
                          remote_engine_id="P", remote_request_id="r", remote_host="localhost",
                          remote_port=7000, tp_size=1)
    # The prefill side holds the blocks, and keeps stepping, with no unfinished request.
    assert len(held) == 3 and num_free(p) == NUM_BLOCKS - 4
    assert not p.has_unfinished_requests() and p.has_requests()
    assert list(p.schedule().kv_connector_metadata.reqs_to_send) == ["r"]

    d.add_request(make_request("r", prompt, max_tokens=3, kv_transfer_params=params))
    out = d.schedule()
    request = d.requests["r"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not out.num_scheduled_tokens
    read = out.kv_connector_metadata.reqs_to_recv["r"]
    assert read.remote_block_ids == held and len(read.local_block_ids) == 3
    assert d.get_request_counts() == (0, 1) and num_free(d) == NUM_BLOCKS - 4
    # vllm:num_requests_waiting_by_reason{reason="deferred"}
    assert d.make_stats().num_deferred_waiting_reqs == 1
    # Parked blocks are not in the prefix cache until their KV is there.
    assert not d.kv_cache_manager.block_pool.cached_block_hash_to_block

    d.update_from_output(out, fake_model_output(d, out))  # still reading: nothing changes
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    report(d, finished_recving={"r"})
    report(p, finished_sending={"r"})
    assert_empty(p)

    # The decode instance computes the last prompt token only, then decodes.
    st = step(d)
    outputs = st.outputs
    assert st.scheduled == {"r": 1}
    assert st.out.scheduled_new_reqs[0].num_computed_tokens == 9
    assert len(d.kv_cache_manager.block_pool.cached_block_hash_to_block) == 2
    while d.has_unfinished_requests():
        more = step(d).outputs
        outputs += more
    assert sum(len(o.new_token_ids) for o in outputs) == 3
    # Parking is no scheduling: one SCHEDULED event, when it ran (the queue time spans the read).
    assert [e.type.name for e in outputs[0].events] == ["QUEUED", "SCHEDULED"]
    assert d.make_stats().num_deferred_waiting_reqs == 0
    assert_empty(d)


def test_prefix_hit_on_the_decode_side_reads_only_the_tail():
    p, d = make_pd_scheduler("P"), make_pd_scheduler("D")
    prompt = list(range(200, 213))  # 13 tokens: 4 blocks, the first 2 cached on d below
    d.add_request(make_request("warm", prompt[:9], max_tokens=1))
    step(d)
    params = prefill(p, prompt)
    d.add_request(make_request("r", prompt, max_tokens=2, kv_transfer_params=params))
    read = d.schedule().kv_connector_metadata.reqs_to_recv["r"]
    assert len(read.local_block_ids) == 2 and read.remote_block_ids[-2:] == params[
        "remote_block_ids"][-2:]
    report(d, finished_recving={"r"})
    out = step(d).out
    assert out.num_scheduled_tokens == {"r": 1}
    while d.has_unfinished_requests():
        step(d)
    report(p, finished_sending={"r"})
    assert_empty(p)
    assert_empty(d)


def reported(in_flight, **kv_output):
    """A step in flight (schedule_step's) whose worker side will report kv_output."""
    in_flight[1].kv_connector_output = KVConnectorOutput(**kv_output)
    return in_flight


def test_with_async_scheduling_every_report_lands_with_a_step_in_flight():
    """As EngineCore's batch queue steps: step N+1 is scheduled before N's output (and the
    transfers it reports) is back."""
    p, d = (make_pd_scheduler(name, async_scheduling=True) for name in "PD")
    prompt = list(range(100, 110))
    p.add_request(make_request("r", prompt, max_tokens=1,
                               kv_transfer_params={"do_remote_decode": True}))
    first = schedule_step(p)
    # r's one token is in flight: nothing more is scheduled for it, and nothing is held yet.
    second = schedule_step(p)
    assert first[0].num_scheduled_tokens == {"r": 10} and not second[0].num_scheduled_tokens
    assert not second[0].kv_connector_metadata.reqs_to_send
    [output] = finish_step(p, first).outputs
    params = output.kv_transfer_params
    assert output.finish_reason == FinishReason.LENGTH and params["do_remote_prefill"]
    assert num_free(p) == NUM_BLOCKS - 4  # held for the peer
    third = schedule_step(p)
    assert list(third[0].kv_connector_metadata.reqs_to_send) == ["r"]
    finish_step(p, second)

    d.add_request(make_request("r", prompt, max_tokens=3, kv_transfer_params=params))
    parked = schedule_step(d)
    assert "r" in parked[0].kv_connector_metadata.reqs_to_recv
    in_flight = schedule_step(d)
    finish_step(d, parked)
    # The read ends in a step that runs while the next one is scheduled.
    landed = reported(schedule_step(d), finished_recving={"r"})
    finish_step(d, in_flight)
    in_flight = schedule_step(d)
    assert not in_flight[0].num_scheduled_tokens  # the report is not back yet
    finish_step(d, landed)
    # The peer's read notification lands while the prefill side has a step in flight too.
    finish_step(p, reported(third, finished_sending={"r"}))
    assert_empty(p)
    tokens = []
    while d.has_requests():
        scheduled = schedule_step(d)
        tokens += finish_step(d, in_flight).tokens.get("r", [])
        in_flight = scheduled
    finish_step(d, in_flight)
    assert len(tokens) == 3
    assert_empty(d)


def test_abort_before_the_read_notifies_the_prefill_side():
    p, d = make_pd_scheduler("P"), make_pd_scheduler("D")
    params = prefill(p, list(range(300, 310)))
    d.add_request(make_request("r", list(range(300, 310)), kv_transfer_params=params))
    d.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert not d.requests and d.has_requests()  # the notification is still to be sent
    read = d.schedule().kv_connector_metadata.reqs_to_recv["r"]
    assert read.local_block_ids == [] and read.remote_request_id == "r"
    assert_empty(d)
    report(p, finished_sending={"r"})  # the notification freed the prefill side's blocks
    assert_empty(p)


def test_abort_during_the_read_holds_the_blocks_until_it_ends():
    p, d = make_pd_scheduler("P"), make_pd_scheduler("D")
    params = prefill(p, list(range(400, 410)))
    d.add_request(make_request("r", list(range(400, 410)), kv_transfer_params=params))
    d.schedule()  # parked, read started
    d.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    # The read may still be writing into the blocks: they wait for it.
    assert d.requests["r"].status == RequestStatus.FINISHED_ABORTED
    assert not d.has_unfinished_requests() and d.has_requests()
    assert num_free(d) == NUM_BLOCKS - 4
    out = d.schedule()
    assert "r" in out.finished_req_ids and not out.num_scheduled_tokens
    report(d, finished_recving={"r"})
    assert_empty(d)
    report(p, finished_sending={"r"})
    assert_empty(p)


def test_a_failed_read_recomputes_from_the_first_bad_block():
    p, d = make_pd_scheduler("P"), make_pd_scheduler("D")
    params = prefill(p, list(range(500, 510)))
    d.add_request(make_request("r", list(range(500, 510)), max_tokens=2,
                               kv_transfer_params=params))
    local = d.schedule().kv_connector_metadata.reqs_to_recv["r"].local_block_ids
    report(d, finished_recving={"r"}, invalid_block_ids={local[1]})
    out = step(d).out
    # Block 0 arrived; blocks 1 and 2 (tokens 4-9) are computed here.
    assert out.num_scheduled_tokens == {"r": 6}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4
    while d.has_unfinished_requests():
        step(d)
    assert_empty(d)
    report(p, finished_sending={"r"})
    assert_empty(p)


def test_a_read_that_failed_entirely_recomputes_everything():
    d = make_pd_scheduler("D")
    params = prefill(make_pd_scheduler("P"), list(range(600, 610)))
    d.add_request(make_request("r", list(range(600, 610)), max_tokens=1,
                               kv_transfer_params=params))
    local = d.schedule().kv_connector_metadata.reqs_to_recv["r"].local_block_ids
    report(d, finished_recving={"r"}, invalid_block_ids=set(local))
    out = step(d).out
    assert out.num_scheduled_tokens == {"r": 10}
    assert not out.kv_connector_metadata.reqs_to_recv  # one transfer per request
    assert_empty(d)


def test_a_prefill_that_stops_early_or_is_aborted_holds_nothing():
    p = make_pd_scheduler("P")
    p.add_request(make_request("r", 6, max_tokens=1, eos_token_id=1000,
                               kv_transfer_params={"do_remote_decode": True}))
    outputs = step(p).outputs  # the fake model samples 1000: EOS
    assert outputs[0].finish_reason == FinishReason.STOP
    assert outputs[0].kv_transfer_params is None
    p.add_request(make_request("a", 6, kv_transfer_params={"do_remote_decode": True}))
    p.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert_empty(p)


def fake_engine(timeout_s: float) -> EngineCore:
    return make_engine_core(create_engine_config(
        runner="simulated", block_size=BLOCK_SIZE, max_model_len=64,
        kv_transfer_config=KVTransferConfig(
            "FakeNixlConnector", "kv_producer", "P", {"abort_request_timeout": timeout_s},
            kv_connector_module_path="fake_connector")))


def test_the_prefill_side_frees_held_blocks_at_the_deadline_while_otherwise_idle():
    engine = fake_engine(timeout_s=0.3)
    free_at_start = num_free(engine.scheduler)
    engine.add_request(make_request("r", list(range(10)), max_tokens=1,
                                    kv_transfer_params={"do_remote_decode": True}))
    # The deadline counts from the finish, inside the step: at or after this.
    started = time.perf_counter()
    outputs, _ = engine.step()
    assert outputs[0].kv_transfer_params["remote_block_ids"]
    steps = 0
    while engine.scheduler.has_requests():
        assert not engine.scheduler.has_unfinished_requests()
        assert engine.step() == ([], False)  # nothing to compute: the steps only poll
        steps += 1
        assert time.perf_counter() - started < 5, "the held blocks were never freed"
    assert time.perf_counter() - started >= 0.3 and steps > 1
    assert not engine.scheduler.requests and num_free(engine.scheduler) == free_at_start
    assert engine.step() == ([], False)


def test_the_prefill_side_frees_held_blocks_once_read():
    engine = fake_engine(timeout_s=60)
    engine.add_request(make_request("r", list(range(10)), max_tokens=1,
                                    kv_transfer_params={"do_remote_decode": True}))
    engine.step()
    engine.step()  # the worker side now knows the request is held
    engine.kv_connectors.worker_side.connector_worker.notify("r")
    engine.step()
    assert not engine.scheduler.has_requests()


@pytest.mark.parametrize("text, message", [
    ('{"kv_connector": "NixlConnector"}', "kv_role must be one of"),
    ('{"kv_connector": "Nope", "kv_role": "kv_both"}', "unknown kv_connector 'Nope'"),
    ('{"kv_role": "kv_both"}', "kv_connector is required"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": 3}',
     "must be a JSON object"),
    ('{"kv_connector": "NixlConnector", "role": "kv_both"}', "keys among"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "skip"}',
     "kv_load_failure_policy must be one of recompute, fail, got 'skip'"),
])
def test_bad_kv_transfer_configs_are_refused_clearly(text, message):
    result = subprocess.run([sys.executable, "-m", "minicore", "serve", "--kv-transfer-config",
                             text], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_connector_modules_import_no_heavy_modules():
    code = ("import sys\nimport minicore.scheduler, minicore.kv_transfer.nixl, "
            "minicore.kv_transfer.factory\n"
            "print(sorted({n.split('.')[0] for n in sys.modules} & {'torch', 'zmq', "
            "'transformers', 'nixl', 'numpy'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


def test_the_worker_side_keeps_every_field_of_the_runners_output():
    """It adds the connector's report to the runner's output; a prefill instance's one-token answer
    once lost its logprobs here (a 500 for logprobs through the proxy)."""
    from types import SimpleNamespace

    from minicore.kv_transfer.worker import execute_model_with_kv_connector
    from minicore.scheduler.output import ModelRunnerOutput

    ran = ModelRunnerOutput(["r"], {"r": 0}, [[7]], logprobs={"r": "rows"},
                            prompt_logprobs={"r": "prompt rows"})
    runner = SimpleNamespace(execute_model=lambda so: ran)
    connector = SimpleNamespace(
        bind_connector_metadata=lambda meta: None, start_load_kv=lambda: None,
        wait_for_save=lambda: None, get_finished=lambda ids: ({"r"}, None),
        get_block_ids_with_load_errors=lambda: {3}, clear_connector_metadata=lambda: None)
    out = execute_model_with_kv_connector(runner, connector,
                                          SimpleNamespace(kv_connector_metadata=None,
                                                          finished_req_ids=set()))
    assert out is not ran and ran.kv_connector_output is None
    assert (out.sampled_token_ids, out.logprobs, out.prompt_logprobs) == (
        [[7]], {"r": "rows"}, {"r": "prompt rows"})
    assert out.kv_connector_output == KVConnectorOutput({"r"}, None, {3})
