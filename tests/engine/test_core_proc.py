"""EngineCoreProc in its own process, driven by a fake frontend over real sockets: the startup
handshake and its timeout, clean exit on SIGTERM/SIGINT, malformed frames dropped without harm,
aborts and reused request ids that arrive during a step, utilities, and ENGINE_CORE_DEAD on a
fatal error.

Every test bounds each wait (socket polls and joins have timeouts) and kills its engine on exit."""

import os
import signal
import time

import msgspec
import pytest
from engine_helpers import FakeFrontend, simulated_config

from minicore.engine.launch import run_engine_core
from minicore.model.simulated import (
    DEFAULT_EOS_TOKEN_IDS,
    DEFAULT_VOCAB_SIZE,
    NOMINAL_KV_BYTES_PER_TOKEN,
    SimulatedModelRunner,
    next_token,
)
from minicore.protocol import EngineCoreRequest, EngineCoreRequestType, engine_dead_frame
from minicore.request import FinishReason
from minicore.sampling_params import SamplingParams

ADD, ABORT, UTILITY = (EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT,
                       EngineCoreRequestType.UTILITY)


def add(frontend: FakeFrontend, request_id: str, max_tokens: int, prompt=(1, 2, 3)) -> None:
    params = SamplingParams(max_tokens=max_tokens)
    frontend.send(ADD, EngineCoreRequest(request_id, list(prompt), params, 2, time.monotonic()))


def collect(frontend: FakeFrontend, request_ids: set[str], timeout: float = 10) -> dict:
    """Every output until all of request_ids finished: request id -> (tokens, finish reason)."""
    results = {rid: ([], None) for rid in request_ids}
    deadline = time.monotonic() + timeout
    while any(reason is None for _, reason in results.values()):
        frame = frontend.next_output(max(0.01, deadline - time.monotonic()))
        assert not isinstance(frame, bytes), frame
        for output in frame.outputs:
            tokens, _ = results[output.request_id]
            results[output.request_id] = (tokens + output.new_token_ids, output.finish_reason)
    return results


def utility(frontend: FakeFrontend, call_id: int, method: str, *args):
    frontend.send(UTILITY, (call_id, method, list(args)))
    while (frame := frontend.next_output()).utility_output is None:
        pass
    assert frame.utility_output.call_id == call_id
    return frame.utility_output


def test_handshake_reports_kv_blocks():
    config = simulated_config(kv_cache_memory=300 * NOMINAL_KV_BYTES_PER_TOKEN * 16)
    with FakeFrontend() as frontend:
        frontend.start(run_engine_core, config)
        ready = frontend.complete_handshake()
        assert frontend.identity == (0).to_bytes(2, "little")
        assert ready == {"status": "READY", "engine_index": 0, "num_gpu_blocks": 300}
        # The first frame after READY: the idle engine's stats.
        assert frontend.next_output().scheduler_stats.num_running_reqs == 0
        assert utility(frontend, 1, "ping").result == "pong"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_exits_cleanly_mid_work(sig):
    with FakeFrontend() as frontend:
        proc = frontend.start(run_engine_core, simulated_config(step_s=0.01))
        frontend.complete_handshake()
        add(frontend, "r", max_tokens=10_000)
        while not frontend.next_output().outputs:
            pass
        start = time.monotonic()
        os.kill(proc.pid, sig)
        proc.join(10)
        assert proc.exitcode == 0
        assert time.monotonic() - start < 3


def test_handshake_timeout_when_the_frontend_never_answers(capfd):
    with FakeFrontend() as frontend:
        proc = frontend.start(run_engine_core, simulated_config(), handshake_timeout=0.5)
        _, hello = frontend.hello()
        assert hello == {"status": "HELLO", "engine_index": 0}
        proc.join(30)
        assert proc.exitcode == 1
    assert "did not answer this engine's HELLO within 0.5 s" in capfd.readouterr().err


def test_malformed_frames_are_dropped_and_the_engine_serves_on(capfd):
    with FakeFrontend() as frontend:
        proc = frontend.start(run_engine_core, simulated_config())
        frontend.complete_handshake()
        valid = frontend.encoder.encode(
            EngineCoreRequest("bad", [1], SamplingParams(), 2, time.monotonic()))
        garbage = [
            [b"\x7f", b"payload"],                      # unknown type byte
            [ADD.value, b"\xc1\xc1 not msgpack"],       # undecodable payload
            [ADD.value, frontend.encoder.encode({"request_id": "x"})],  # wrong shape
            [ABORT.value, frontend.encoder.encode(123)],  # abort of something not a list
            [UTILITY.value],                             # missing payload frame
            [b"", b"", b""],                             # three frames
        ]
        for frames in garbage:
            frontend.send_raw(*frames)
        # An ADD that names itself but does not decode (max_tokens 0) is refused by name.
        frontend.send_raw(ADD.value, valid.replace(b"\x10", b"\x00", 1))
        add(frontend, "good", max_tokens=5)
        results = collect(frontend, {"good", "bad"})
        assert results["good"][1] is FinishReason.LENGTH and len(results["good"][0]) == 5
        assert results["bad"] == ([], FinishReason.ERROR)
        assert utility(frontend, 7, "get_stats").result["request_ids"] == []
        assert proc.is_alive()
    assert capfd.readouterr().err.count("dropped a malformed message") == len(garbage)


def test_requests_the_engine_cannot_run_are_refused_alone():
    """The engine trusts no frontend: prompt ids outside the vocabulary, and sampling values no
    kernel can carry (top_k 2**63, which passed validation and killed the engine), finish with
    an error for that request alone while a request beside them runs to its end."""
    with FakeFrontend() as frontend:
        proc = frontend.start(run_engine_core, simulated_config())
        frontend.complete_handshake()
        add(frontend, "beside", max_tokens=20)
        add(frontend, "vocab", 3, prompt=[5, 10**6])
        add(frontend, "negative", 3, prompt=[-1, 5])
        valid = EngineCoreRequest("top-k", [1], SamplingParams(top_k=7), 2, time.monotonic())
        fields = msgspec.msgpack.decode(frontend.encoder.encode(valid))
        fields[2]["top_k"] = 2**63  # past what the frontend's SamplingParams lets through
        frontend.send_raw(ADD.value, msgspec.msgpack.encode(fields))
        results = collect(frontend, {"beside", "vocab", "negative", "top-k"})
        assert {rid: r for rid, r in results.items() if rid != "beside"} == {
            rid: ([], FinishReason.ERROR) for rid in ("vocab", "negative", "top-k")}
        assert results["beside"][1] is FinishReason.LENGTH and len(results["beside"][0]) == 20
        assert utility(frontend, 9, "get_stats").result["request_ids"] == []
        assert proc.is_alive()


def start_long_request(frontend: FakeFrontend, request_id: str) -> None:
    """An engine with 0.3 s steps, running request_id: returns at its first output, as the next
    step starts."""
    frontend.start(run_engine_core, simulated_config(step_s=0.3))
    frontend.complete_handshake()
    add(frontend, request_id, max_tokens=100)
    while not (frame := frontend.next_output()).outputs:
        pass
    assert [o.request_id for o in frame.outputs] == [request_id]


def test_an_abort_during_a_step_takes_effect_after_it():
    with FakeFrontend() as frontend:
        start_long_request(frontend, "r")
        # The engine started the next step as it sent that output; the abort lands inside it and
        # waits for the step's end, as in vLLM (the frontend drops the step's output).
        frontend.send(ABORT, ["r"])
        frame = frontend.next_output()
        assert [(o.request_id, o.finish_reason) for o in frame.outputs] == [("r", None)]
        while (frame := frontend.next_output()).scheduler_stats.num_running_reqs:
            assert frame.outputs == []
        assert frame.scheduler_stats.kv_cache_usage == 0
        assert utility(frontend, 1, "get_stats").result["request_ids"] == []


def test_a_request_id_reused_during_a_step_never_gets_the_old_requests_token():
    """ABORT X then ADD X while a step of the old X runs: the new X's tokens are its own."""
    new_prompt = [7, 8, 9]
    expected, tokens = [], list(new_prompt)
    for _ in range(3):
        tokens.append(next_token(tokens, DEFAULT_VOCAB_SIZE, frozenset(DEFAULT_EOS_TOKEN_IDS)))
        expected.append(tokens[-1])
    with FakeFrontend() as frontend:
        start_long_request(frontend, "x")
        frontend.send(ABORT, ["x"])
        add(frontend, "x", max_tokens=3, prompt=new_prompt)
        # The step in flight still reports the old x's token; everything after is the new x's.
        frame = frontend.next_output()
        assert [(o.request_id, o.finish_reason) for o in frame.outputs] == [("x", None)]
        assert collect(frontend, {"x"}) == {"x": (expected, FinishReason.LENGTH)}


def test_concurrent_requests_and_utilities():
    with FakeFrontend() as frontend:
        frontend.start(run_engine_core, simulated_config())
        frontend.complete_handshake()
        for i in range(20):
            add(frontend, f"r{i}", max_tokens=i + 1, prompt=[i + 1] * (i + 1))
        results = collect(frontend, {f"r{i}" for i in range(20)})
        assert {rid: len(tokens) for rid, (tokens, _) in results.items()} == {
            f"r{i}": i + 1 for i in range(20)}
        unknown = utility(frontend, 2, "shutdown")
        assert unknown.failure_message.startswith(
            "call to shutdown failed: unknown utility method 'shutdown'")
        assert utility(frontend, 3, "reset_prefix_cache").result is True
        assert "too many positional arguments" in utility(frontend, 4, "ping", 1).failure_message


def poisoned_engine(config, handshake_address, **kwargs):
    """run_engine_core with a runner whose forward fails on requests named "poison*"."""
    execute_model = SimulatedModelRunner.execute_model

    def failing_execute_model(self, scheduler_output):
        if any(r.startswith("poison") for r in scheduler_output.num_scheduled_tokens):
            raise RuntimeError("poisoned forward")
        return execute_model(self, scheduler_output)

    SimulatedModelRunner.execute_model = failing_execute_model
    run_engine_core(config, handshake_address, **kwargs)


def test_fatal_error_sends_engine_core_dead_and_exits_non_zero(capfd):
    with FakeFrontend() as frontend:
        proc = frontend.start(poisoned_engine, simulated_config())
        frontend.complete_handshake()
        add(frontend, "fine", max_tokens=3)
        assert collect(frontend, {"fine"})["fine"][1] is FinishReason.LENGTH
        add(frontend, "poison", max_tokens=3)
        while (frame := frontend.next_output()) != engine_dead_frame(0):
            assert not frame.outputs
        proc.join(10)
        assert proc.exitcode == 1
    err = capfd.readouterr().err
    assert "EngineCore encountered a fatal error" in err and "poisoned forward" in err
