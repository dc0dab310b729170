"""AsyncLLM against a real engine process on the SIMULATED runner: concurrent streams,
aborts (early stop, explicit, stop strings) that free the engine's KV blocks, validation that
sends nothing, and supervision: a killed or stopped engine fails in-flight requests at once.

Every wait is bounded (asyncio.timeout), and every client is shut down, its process joined."""

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time

import msgspec
import pytest
import pytest_asyncio
import zmq
from engine_helpers import simulated_config

from minicore.engine.async_llm import AsyncLLM
from minicore.engine.core_client import EngineDeadError
from minicore.model.simulated import NOMINAL_KV_BYTES_PER_TOKEN, next_token
from minicore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    engine_dead_frame,
)
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def start_client(config, timeout: float = 60) -> AsyncLLM:
    return await asyncio.wait_for(AsyncLLM.from_engine_config(config), timeout)


@contextlib.asynccontextmanager
async def running_client(config):
    client = await start_client(config)
    try:
        yield client
    finally:
        await client.shutdown()
        assert client.engine_core.procs[0].exitcode is not None


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client():
    config = simulated_config(kv_cache_memory=400 * NOMINAL_KV_BYTES_PER_TOKEN * 16)
    async with running_client(config) as client:
        yield client


def simulated_tokens(client: AsyncLLM, prompt: list[int], n: int) -> list[int]:
    token_ids = list(prompt)
    eos = frozenset({client.tokenizer.eos_token_id})
    for _ in range(n):
        token_ids.append(next_token(token_ids, client.vocab_size, eos))
    return token_ids[len(prompt):]


async def assert_idle(client: AsyncLLM) -> None:
    stats = await client.call_utility("get_stats")
    assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (0, 0)
    assert stats["kv_cache_usage"] == 0 and stats["request_ids"] == []
    # The engine published the same before answering, so the frontend's view is current too.
    latest = client.latest_stats[0]
    assert (latest.num_running_reqs, latest.kv_cache_usage) == (0, 0)
    assert client.output_processor.request_states == {}


async def test_startup(client):
    assert client.num_blocks == 400
    assert client.is_healthy and not client.errored
    assert client.model_name == "SmolLM2-135M-Instruct"
    assert client.engine_core.procs[0].is_alive()
    assert await client.call_utility("ping") == "pong"


async def test_50_concurrent_streams_each_complete_once(client):
    finished = []
    client.output_processor.on_request_finished = finished.append

    async def stream(i: int):
        prompt = [100 + i] * (1 + i % 20)
        max_tokens = 1 + i % 17
        params = SamplingParams(max_tokens=max_tokens)
        outputs = [o async for o in client.generate(prompt, params, f"req-{i}")]
        token_lists = [o.outputs[0].token_ids for o in outputs]
        # Cumulative: each output extends the one before; only the last is finished.
        assert all(a == b[:len(a)] and len(a) < len(b)
                   for a, b in itertools.pairwise(token_lists))
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        last = outputs[-1].outputs[0]
        assert last.token_ids == simulated_tokens(client, prompt, max_tokens)
        assert last.finish_reason == "length"
        assert last.text == client.tokenizer.decode(last.token_ids, skip_special_tokens=True)
        return outputs[-1].request_id

    try:
        async with asyncio.timeout(30):
            ids = await asyncio.gather(*(stream(i) for i in range(50)))
    finally:
        client.output_processor.on_request_finished = None
    assert sorted(ids) == sorted(f"req-{i}" for i in range(50))
    assert sorted(state.request_id for state in finished) == sorted(ids)
    await assert_idle(client)


async def test_consumer_stopping_early_aborts_and_frees(client):
    finished = []
    client.output_processor.on_request_finished = finished.append
    try:
        async with asyncio.timeout(10):
            params = SamplingParams(max_tokens=450)
            async with contextlib.aclosing(client.generate([7] * 40, params, "early")) as it:
                async for output in it:
                    if len(output.outputs[0].token_ids) >= 3:
                        break
            await assert_idle(client)
    finally:
        client.output_processor.on_request_finished = None
    assert [(s.request_id, s.finish_reason) for s in finished] == [("early", "abort")]


async def test_cancelled_consumer_aborts_and_frees(client):
    """A consumer cancelled while it awaits something else (a client disconnect while the server
    writes) aborts the request as it closes the stream."""
    finished = []
    client.output_processor.on_request_finished = finished.append

    async def consume():
        params = SamplingParams(max_tokens=450)
        async with contextlib.aclosing(client.generate([8] * 40, params, "cancelled")) as it:
            async for _ in it:
                asyncio.current_task().cancel()
                await asyncio.sleep(10)

    try:
        async with asyncio.timeout(10):
            with pytest.raises(asyncio.CancelledError):
                await asyncio.create_task(consume())
            await assert_idle(client)
    finally:
        client.output_processor.on_request_finished = None
    assert [(s.request_id, s.finish_reason) for s in finished] == [("cancelled", "abort")]


async def test_stream_read_from_several_tasks(client):
    """Merging streams reads each with anext() in a new task (vLLM's merge_async_iterators):
    a reading task that ends is not an abandoned stream."""
    streams = [client.generate([20 + i], SamplingParams(max_tokens=30), f"merge-{i}")
               for i in range(3)]
    last = {}
    async with asyncio.timeout(10):
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                with contextlib.suppress(StopAsyncIteration):
                    last[i] = future.result()
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in last.values())
    assert [len(last[i].outputs[0].token_ids) for i in range(3)] == [30, 30, 30]
    await assert_idle(client)


async def test_explicit_abort_ends_the_stream_with_abort(client):
    finished = []
    client.output_processor.on_request_finished = finished.append
    try:
        async with asyncio.timeout(10):
            outputs = []
            async for output in client.generate([9] * 8, SamplingParams(max_tokens=450),
                                                "aborted"):
                outputs.append(output)
                if len(outputs) == 2:
                    await client.abort("aborted")
            await client.abort("aborted")  # finished already: ignored
    finally:
        client.output_processor.on_request_finished = None
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert [s.request_id for s in finished] == ["aborted"]
    await assert_idle(client)


async def test_stop_string_finishes_the_request_and_frees_it(client):
    prompt = [11, 12, 13]
    tokens = simulated_tokens(client, prompt, 30)
    text = client.tokenizer.decode(tokens, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(max_tokens=400, stop=[stop])
    async with asyncio.timeout(10):
        outputs = [o async for o in client.generate(prompt, params, "stopped")]
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[:text.index(stop)]
    assert all(stop not in o.outputs[0].text for o in outputs)
    await assert_idle(client)


async def test_invalid_requests_raise_and_send_nothing(client):
    async def first(prompt_token_ids, params=None, request_id="bad"):
        params = SamplingParams() if params is None else params
        return await anext(client.generate(prompt_token_ids, params, request_id))

    async with asyncio.timeout(10):
        with pytest.raises(ValueError, match="the prompt is empty"):
            await first([])
        too_long = r"the prompt has 513 tokens, more than max_model_len \(512\)"
        with pytest.raises(ValueError, match=too_long):
            await first([5] * 513)
        # As vLLM: a prompt must leave room for one output token.
        with pytest.raises(ValueError, match=r"512 tokens, as many as max_model_len \(512\)"):
            await first([5] * 512)
        with pytest.raises(ValueError, match=r"must be integers in \[0, 49152\)"):
            await first([5, 49152])
        with pytest.raises(ValueError, match="must be integers"):
            await first([5, 6.0])
        with pytest.raises(ValueError, match="must be SamplingParams"):
            await first([5], params={"max_tokens": 3})
        running = client.generate([5], SamplingParams(max_tokens=450), "dup")
        await anext(running)
        with pytest.raises(ValueError, match="'dup' is already in use"):
            await first([6], request_id="dup")
        await running.aclose()
        await assert_idle(client)


async def test_killed_engine_fails_in_flight_requests_fast():
    async with running_client(simulated_config(step_s=0.005)) as client:
        async def stream(i):
            params = SamplingParams(max_tokens=450)
            async for _ in client.generate([i + 1] * 4, params, f"k{i}"):
                pass

        async with asyncio.timeout(20):
            tasks = [asyncio.create_task(stream(i)) for i in range(8)]
            while sum(bool(s.token_ids)
                      for s in client.output_processor.request_states.values()) < 8:
                await asyncio.sleep(0.005)
            start = time.monotonic()
            os.kill(client.engine_core.procs[0].pid, signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            elapsed = time.monotonic() - start
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "exited with code -9" in str(results[0])
        assert elapsed < 2
        assert client.errored and not client.is_healthy
        with pytest.raises(EngineDeadError):
            await anext(client.generate([1], SamplingParams(), "late"))
        with pytest.raises(EngineDeadError):
            await client.call_utility("ping")


async def test_sigterm_to_the_engine_exits_cleanly_and_fails_in_flight():
    async with running_client(simulated_config(step_s=0.005)) as client:
        async with asyncio.timeout(20):
            stream = client.generate([3, 4], SamplingParams(max_tokens=450), "t")
            await anext(stream)
            os.kill(client.engine_core.procs[0].pid, signal.SIGTERM)
            with pytest.raises(EngineDeadError, match="exited with code 0"):
                async for _ in stream:
                    pass
        assert client.engine_core.procs[0].exitcode == 0
        assert not client.is_healthy


async def test_engine_that_fails_to_start_is_reported():
    # Too little KV cache for one max_model_len request: the engine fails while building.
    config = simulated_config(kv_cache_memory=NOMINAL_KV_BYTES_PER_TOKEN * 16)
    with pytest.raises(RuntimeError, match="exited with code 1 during startup"):
        await start_client(config)


async def test_shutdown_stops_the_engine_and_fails_in_flight():
    client = await start_client(simulated_config(step_s=0.005))
    async with asyncio.timeout(20):
        stream = client.generate([3, 4], SamplingParams(max_tokens=450), "s")
        await anext(stream)
        start = time.monotonic()
        await client.shutdown()
        assert time.monotonic() - start < 5
        assert client.engine_core.procs[0].exitcode == 0
        with pytest.raises(EngineDeadError, match="shut down"):
            await anext(stream)
        await client.shutdown()  # idempotent


async def test_failing_output_hook_fails_requests_instead_of_hanging_them():
    async with running_client(simulated_config()) as client:
        def broken_hook(state, num_new_tokens, interval):
            raise KeyError("metrics bug")

        client.output_processor.on_new_tokens = broken_hook
        async with asyncio.timeout(10):
            with pytest.raises(EngineDeadError, match="output handler failed"):
                async for _ in client.generate([1, 2], SamplingParams(max_tokens=5), "h"):
                    pass
        assert client.errored and not client.is_healthy


async def test_malformed_output_frames_are_dropped_and_the_client_keeps_serving(client, caplog):
    """Whatever a local process pushes into the frontend's output socket (garbage, msgpack of the
    wrong shape, a frame or ENGINE_CORE_DEAD naming an engine that does not exist, a fatal-error
    notice in a local engine's name) is dropped, logged at 1, 2, 4, ... drops, and the client
    keeps serving: one garbage frame used to kill the output handler."""
    address = client.engine_core.output_socket.getsockopt_string(zmq.LAST_ENDPOINT)
    ctx = zmq.Context()
    forger = ctx.socket(zmq.PUSH)
    forger.connect(address)
    forged = [b"garbage", msgspec.msgpack.encode({"outputs": 1}),
              msgspec.msgpack.encode(EngineCoreOutputs(7, [EngineCoreOutput("ghost", [5])])),
              ENGINE_CORE_DEAD, engine_dead_frame(9),
              engine_dead_frame(0),  # the local engine's process is alive: no effect
              msgspec.msgpack.encode(EngineCoreOutputs(0, [EngineCoreOutput("ghost", [5])]))]
    try:
        with caplog.at_level(logging.ERROR, logger="minicore.engine.core_client"):
            for frame in forged:
                forger.send(frame)
            async with asyncio.timeout(10):
                # Frames of one peer are read in order: the last forged one marks the end.
                while not any("reports a fatal error" in r.getMessage() for r in caplog.records):
                    await asyncio.sleep(0.01)
                outputs = [o async for o in client.generate([4, 5], SamplingParams(max_tokens=3),
                                                            "after-forgery")]
    finally:
        forger.close(linger=0)
        ctx.term()
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
    assert client.is_healthy and not client.errored
    assert 7 not in client.latest_stats and 9 not in client.latest_stats
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 3 and dropped[-1].endswith("(4 dropped so far)"), dropped
    await assert_idle(client)


async def test_the_input_socket_holds_only_a_few_frames_from_a_stranger(client):
    """The frontend's input ROUTER reads nothing after startup: frames a stranger sends it wait in
    a short queue and then the stranger is held back, instead of piling up in memory (100 MB of
    frames used to be buffered)."""
    address = client.engine_core.input_socket.getsockopt_string(zmq.LAST_ENDPOINT)
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.SNDHWM, 100)
    stranger.connect(address)
    accepted = 0
    try:
        async with asyncio.timeout(10):
            while accepted < 100_000:
                try:
                    stranger.send(b"x" * 512, zmq.NOBLOCK)
                except zmq.Again:
                    # Not yet connected, or held back: wait a moment, and stop if still held.
                    await asyncio.sleep(0.2)
                    try:
                        stranger.send(b"x" * 512, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                accepted += 1
    finally:
        stranger.close(linger=0)
        ctx.term()
    # The stranger's own queue, the frontend's and the kernel's buffers: a few thousand at most.
    assert accepted < 5_000, accepted
    async with asyncio.timeout(10):
        outputs = [o async for o in client.generate([6], SamplingParams(max_tokens=2), "after")]
    assert outputs[-1].finished and client.is_healthy
