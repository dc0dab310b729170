"""The wire protocol: every message survives a msgpack round trip unchanged, and what is not a
valid message fails to decode (so the engine can drop it) instead of producing a bad one."""

import msgspec
import pytest

from minicore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    LogprobsLists,
    SchedulerStats,
    UtilityOutput,
)
from minicore.request import FinishReason
from minicore.sampling_params import SamplingParams

encoder = msgspec.msgpack.Encoder()


def round_trip(value, type_):
    return msgspec.msgpack.Decoder(type_).decode(encoder.encode(value))


def test_request_round_trip_keeps_every_field():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=-3,
                            stop_token_ids=[4, 5], ignore_eos=True, min_tokens=2,
                            stop=["\n\n", "END"])
    request = EngineCoreRequest("req-1", [1, 2, 3], params, eos_token_id=2, arrival_time=12.5,
                                priority=-4, cache_salt="salt", data_parallel_rank=1,
                                current_wave=3)
    decoded = round_trip(request, EngineCoreRequest)
    assert decoded == request
    assert isinstance(decoded.sampling_params, SamplingParams)


def test_request_defaults_round_trip():
    request = EngineCoreRequest("r", [9], SamplingParams(), None, 0.0)
    decoded = round_trip(request, EngineCoreRequest)
    assert decoded == request
    assert (decoded.priority, decoded.cache_salt, decoded.data_parallel_rank) == (0, None, None)


def test_outputs_round_trip_keeps_every_field():
    outputs = EngineCoreOutputs(
        engine_index=2,
        outputs=[EngineCoreOutput("a", [5, 6]),
                 EngineCoreOutput("b", [7], FinishReason.STOP, stop_reason=7, num_cached_tokens=16),
                 EngineCoreOutput("c", [], FinishReason.ABORT)],
        scheduler_stats=SchedulerStats(3, 1, 0.25, 10, 4, 1), timestamp=123.25,
        utility_output=UtilityOutput(9, {"num_running_reqs": 0, "request_ids": ["x"]}),
        num_received_requests=7, wave_complete=4, start_wave=5)
    decoded = round_trip(outputs, EngineCoreOutputs)
    assert decoded == outputs
    assert decoded.outputs[1].finish_reason is FinishReason.STOP
    assert [o.finished for o in decoded.outputs] == [False, True, True]


def test_utility_failure_round_trip():
    output = UtilityOutput(1, failure_message="unknown utility method 'x'")
    assert round_trip(output, UtilityOutput) == output


def test_request_types_are_distinct_single_bytes():
    values = [t.value for t in EngineCoreRequestType]
    assert all(isinstance(v, bytes) and len(v) == 1 for v in values)
    assert len(set(values)) == len(values)
    assert EngineCoreRequestType(b"\x00") is EngineCoreRequestType.ADD
    with pytest.raises(ValueError):
        EngineCoreRequestType(b"\x7f")
    # The dead signal can never be mistaken for an EngineCoreOutputs frame (a msgpack array).
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.Decoder(EngineCoreOutputs).decode(ENGINE_CORE_DEAD)


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"garbage", encoder.encode({"a": 1}),
                                     encoder.encode(["r", [1], "not params", None, 0.0])])
def test_garbage_does_not_decode_as_a_request(payload):
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.Decoder(EngineCoreRequest).decode(payload)


def test_invalid_sampling_params_fail_to_decode():
    """SamplingParams.__post_init__ runs on decode: the engine never sees invalid values."""
    valid = encoder.encode(EngineCoreRequest("r", [1], SamplingParams(), 2, 0.0))
    invalid = valid.replace(encoder.encode("max_tokens") + encoder.encode(16),
                            encoder.encode("max_tokens") + encoder.encode(0))
    assert invalid != valid
    with pytest.raises(msgspec.ValidationError, match="max_tokens must be >= 1"):
        msgspec.msgpack.Decoder(EngineCoreRequest).decode(invalid)


def test_logprobs_fields_round_trip():
    """Sampling extras reach the engine as sent; logprobs come back as LogprobsLists."""
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                            min_p=0.1, logit_bias={3: 1.5}, allowed_token_ids=[1, 3],
                            bad_words_token_ids=[[4, 5]], logprobs=2, prompt_logprobs=0)
    request = EngineCoreRequest("r", [1, 2], params, 2, 0.0)
    decoded = round_trip(request, EngineCoreRequest)
    assert decoded == request and decoded.sampling_params.logit_bias == {3: 1.5}
    lists = LogprobsLists([[5, 5, 9]], [[-0.5, -0.5, -1.25]], [1])
    output = EngineCoreOutput("r", [5], new_logprobs=lists,
                              new_prompt_logprobs=LogprobsLists([[2]], [[-3.0]], [7]))
    assert round_trip(output, EngineCoreOutput) == output
