"""OutputProcessor with a tiny byte-level tokenizer: streams and finished outputs, stop strings
that ask the caller to abort in the engine, aborts, a request the engine refused (its stream
raises InvalidRequestError), and a dead engine failing every stream; the hooks see each finish."""

import asyncio
import time

import pytest
from test_detokenizer import ByteTokenizer

from minicore.engine.input_processor import InvalidRequestError
from minicore.engine.output_processor import (
    OutputProcessor,
    RequestFailedError,
    RequestOutputCollector,
)
from minicore.outputs import Logprob
from minicore.protocol import EngineCoreOutput, EngineCoreRequest, LogprobsLists
from minicore.request import FinishReason
from minicore.sampling_params import SamplingParams


def request(request_id: str, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(b"hi "), SamplingParams(**params), None,
                             time.monotonic())


@pytest.fixture
def processor():
    processor = OutputProcessor(ByteTokenizer())
    processor.finished = []
    processor.on_request_finished = lambda state: processor.finished.append(
        (state.request_id, state.finish_reason))
    return processor


def test_finished_outputs_without_a_collector_are_returned(processor):
    processor.add_request(request("a"), "hi ")
    first = processor.process_outputs([EngineCoreOutput("a", list(b"ok"))])
    assert first.request_outputs == [] and first.reqs_to_abort == []
    last = processor.process_outputs([EngineCoreOutput("a", list(b"!"), FinishReason.LENGTH)])
    (output,) = last.request_outputs
    assert (output.outputs[0].text, output.outputs[0].finish_reason) == ("ok!", "length")
    assert processor.finished == [("a", "length")] and not processor.has_unfinished_requests()


def test_a_stop_string_finishes_here_and_asks_for_an_engine_abort(processor):
    processor.add_request(request("s", stop=["!"]), None)
    result = processor.process_outputs([EngineCoreOutput("s", list(b"yes! more"))])
    assert result.reqs_to_abort == ["s"]
    assert result.request_outputs[0].outputs[0].text == "yes"
    # Outputs the engine made before it heard of the abort are ignored.
    assert processor.process_outputs([EngineCoreOutput("s", [65])]).request_outputs == []


def test_a_duplicate_request_id_is_refused(processor):
    processor.add_request(request("d"), None)
    with pytest.raises(ValueError, match="'d' is already in use"):
        processor.add_request(request("d"), None)


async def test_a_refused_request_raises_in_its_stream_alone(processor):
    refused, beside = RequestOutputCollector(), RequestOutputCollector()
    processor.add_request(request("bad"), None, refused)
    processor.add_request(request("good"), None, beside)
    processor.process_outputs([
        EngineCoreOutput("bad", [], FinishReason.ERROR, error_message="token id out of range"),
        EngineCoreOutput("good", list(b"x"))])
    with pytest.raises(InvalidRequestError, match="refused request 'bad': token id out of range"):
        await asyncio.wait_for(refused.get(), 1)
    assert (await asyncio.wait_for(beside.get(), 1)).outputs[0].text == "x"
    assert processor.finished == [("bad", "error")]
    assert list(processor.request_states) == ["good"]


async def test_a_request_that_failed_in_the_engine_raises_a_server_error_in_its_stream(processor):
    """A KV load failed under kv_load_failure_policy "fail": not the caller's mistake (the server
    answers 500, not 400); offline, its output finishes with "error"."""
    failed = RequestOutputCollector()
    processor.add_request(request("f"), None, failed)
    processor.add_request(request("offline"), None)
    result = processor.process_outputs([
        EngineCoreOutput(r, [], FinishReason.ERROR, error_message="its KV load failed",
                         failed=True) for r in ("f", "offline")])
    with pytest.raises(RequestFailedError, match="'f' failed in the engine: its KV load failed"):
        await asyncio.wait_for(failed.get(), 1)
    (output,) = result.request_outputs
    assert output.finished and output.outputs[0].finish_reason == "error"
    assert processor.finished == [("f", "error"), ("offline", "error")]


async def test_abort_and_a_dead_engine_end_the_streams(processor):
    aborted, failed = RequestOutputCollector(), RequestOutputCollector()
    processor.add_request(request("ab"), None, aborted)
    processor.add_request(request("f"), None, failed)
    assert [s.request_id for s in processor.abort_requests(["ab", "unknown"])] == ["ab"]
    assert (await asyncio.wait_for(aborted.get(), 1)).outputs[0].finish_reason == "abort"
    processor.fail_all(RuntimeError("engine gone"))
    with pytest.raises(RuntimeError, match="engine gone"):
        await asyncio.wait_for(failed.get(), 1)
    # A dead engine's requests get no finish hook: they did not finish.
    assert processor.finished == [("ab", "abort")] and not processor.has_unfinished_requests()


def test_logprobs_accumulate_with_decoded_tokens_and_ranks(processor):
    """vLLM's layout: the token first (its rank), then the top-N ranked 1..N; a piece of a
    multi-byte character is given the text it completes; prompt logprobs start with None."""
    processor.add_request(request("l", logprobs=1, prompt_logprobs=0), None)
    euro = list("€".encode())
    outputs = [
        EngineCoreOutput("l", [], new_prompt_logprobs=LogprobsLists([[105]], [[-2.0]], [3])),
        EngineCoreOutput("l", [75], new_prompt_logprobs=LogprobsLists([[32]], [[-0.5]], [1]),
                         new_logprobs=LogprobsLists([[75, 76]], [[-1.5, -0.25]], [2])),
        EngineCoreOutput("l", euro[:1], new_logprobs=LogprobsLists([[euro[0], euro[0]]],
                                                                     [[-0.1, -0.1]], [1])),
        EngineCoreOutput("l", euro[1:2], new_logprobs=LogprobsLists([[euro[1], euro[1]]],
                                                                      [[-0.2, -0.2]], [1])),
        EngineCoreOutput("l", euro[2:], FinishReason.LENGTH,
                         new_logprobs=LogprobsLists([[euro[2], 65]], [[-0.3, -0.05]], [2]))]
    (out,) = [o for result in map(lambda o: processor.process_outputs([o]), outputs)
              for o in result.request_outputs]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 3
    assert out.prompt_logprobs[1] == {105: Logprob(-2.0, 3, "i")}
    completion = out.outputs[0]
    assert completion.text == "K€"
    assert completion.logprobs[0] == {75: Logprob(-1.5, 2, "K"), 76: Logprob(-0.25, 1, "L")}
    assert completion.logprobs[1] == {euro[0]: Logprob(-0.1, 1, "")}
    assert completion.logprobs[3][euro[2]] == Logprob(-0.3, 2, "€")
    assert completion.cumulative_logprob == pytest.approx(-1.5 - 0.1 - 0.2 - 0.3)
    assert out.metrics is not None and out.metrics.num_generation_tokens == 4


def test_a_prompt_logprobs_only_output_wakes_no_stream(processor):
    async def run():
        queue = RequestOutputCollector()
        processor.add_request(request("p", prompt_logprobs=0), None, queue)
        processor.process_outputs([EngineCoreOutput(
            "p", [], new_prompt_logprobs=LogprobsLists([[105]], [[-2.0]], [3]))])
        assert not queue.ready.is_set()
        processor.process_outputs([EngineCoreOutput(
            "p", [75], new_prompt_logprobs=LogprobsLists([[32]], [[-0.5]], [1]))])
        out = await queue.get()
        assert [e and list(e) for e in out.prompt_logprobs] == [None, [105], [32]]
        assert out.outputs[0].logprobs is None

    asyncio.run(run())


def test_include_stop_str_in_output_keeps_it_and_holds_nothing_back(processor):
    async def run():
        queue = RequestOutputCollector()
        processor.add_request(request("k", stop=["END"], include_stop_str_in_output=True), None,
                              queue)
        processor.process_outputs([EngineCoreOutput("k", list(b"abc EN"))])
        assert (await queue.get()).outputs[0].text == "abc EN"
        result = processor.process_outputs([EngineCoreOutput("k", list(b"D more"))])
        assert result.reqs_to_abort == ["k"]
        assert (await queue.get()).outputs[0].text == "abc END"

    asyncio.run(run())
