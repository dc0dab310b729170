"""The SIMULATED model runner, in-process through EngineCore: deterministic made-up tokens that
are never EOS, the scheduler's rules (chunked prefill samples only at the end), the cost model,
and KV cache sizing."""

import time

import pytest

from minicore.config import create_engine_config
from minicore.engine.components import make_engine_core
from minicore.engine.core import EngineCore
from minicore.model.config import SimulatedCost
from minicore.model.simulated import (
    DEFAULT_VOCAB_SIZE,
    NOMINAL_KV_BYTES_PER_TOKEN,
    next_token,
)
from minicore.request import Request
from minicore.sampling_params import SamplingParams

EOS = frozenset({2})


def make_engine(**engine_args) -> EngineCore:
    return make_engine_core(create_engine_config(runner="simulated", **engine_args))


def run(engine: EngineCore, requests: list[Request]) -> dict[str, list[int]]:
    tokens = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add_request(request)
    while engine.scheduler.has_unfinished_requests():
        outputs, _ = engine.step()
        for output in outputs:
            tokens[output.request_id] += output.new_token_ids
    return tokens


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    token_ids = list(prompt)
    for _ in range(n):
        token_ids.append(next_token(token_ids, DEFAULT_VOCAB_SIZE, EOS))
    return token_ids[len(prompt):]


def test_tokens_are_deterministic_and_per_request():
    engine = make_engine(max_model_len=256)
    prompts = {"a": [5, 6, 7], "b": [5, 6, 8], "c": list(range(100, 140))}
    requests = [Request(rid, p, SamplingParams(max_tokens=12), eos_token_id=2)
                for rid, p in prompts.items()]
    tokens = run(engine, requests)
    assert tokens == {rid: expected_tokens(p, 12) for rid, p in prompts.items()}
    assert tokens["a"] != tokens["b"]
    assert engine.scheduler.kv_cache_manager.usage == 0


def test_never_emits_eos():
    # A vocabulary of 3 puts EOS (2) in reach of every step; it is always skipped.
    token_ids = [1]
    for _ in range(200):
        token_ids.append(next_token(token_ids, 3, EOS))
    assert 2 not in token_ids
    assert set(token_ids[1:]) == {0, 1}
    assert len({next_token([t], DEFAULT_VOCAB_SIZE, EOS) for t in range(1000)}) > 900


def test_chunked_prefill_samples_only_after_the_last_chunk():
    engine = make_engine(max_model_len=256, max_num_batched_tokens=16,
                         long_prefill_token_threshold=16)
    prompt = list(range(200, 250))  # 50 tokens: chunks of 16, 16, 16, 2
    tokens = run(engine, [Request("long", prompt, SamplingParams(max_tokens=3))])
    assert tokens["long"] == expected_tokens(prompt, 3)


def test_cost_model_sets_the_step_time():
    cost = SimulatedCost(step_s=0.02, prefill_token_s=0.001, decode_seq_s=0.01)
    engine = make_engine(simulated_cost=cost)
    engine.add_request(Request("r", list(range(1, 31)), SamplingParams(max_tokens=5)))
    start = time.perf_counter()
    engine.step()  # prefill of 30 tokens: 0.02 + 0.03
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    engine.step()  # one decode: 0.02 + 0.01
    decode = time.perf_counter() - start
    # The runner sleeps until a deadline, so the lower bounds are exact; the upper ones only
    # have to tell the modelled times apart on a busy machine.
    assert 0.05 <= prefill < 0.05 + 0.25
    assert 0.03 <= decode < prefill


def test_zero_cost_returns_at_once():
    engine = make_engine()
    engine.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=50)))
    start = time.perf_counter()
    while engine.scheduler.has_unfinished_requests():
        engine.step()
    assert time.perf_counter() - start < 0.05


def test_an_empty_schedule_runs_no_forward():
    # A DP rank whose batch is empty (say, held back by the balance gate) runs a dummy batch
    # instead: an empty forward that also took the step time would be two forwards in one step.
    engine = make_engine(simulated_cost=SimulatedCost(step_s=5.0))
    start = time.perf_counter()
    output = engine.model_runner.execute_model(engine.scheduler.schedule())
    assert output.req_ids == [] and time.perf_counter() - start < 2.0


def test_kv_blocks_from_memory_or_explicit():
    engine = make_engine(max_model_len=256, kv_cache_memory=100 * NOMINAL_KV_BYTES_PER_TOKEN * 16)
    assert engine.config.cache_config.num_blocks == 100
    assert make_engine(num_blocks=300, max_model_len=256).config.cache_config.num_blocks == 300
    with pytest.raises(ValueError, match="needs 129"):
        make_engine(max_model_len=2048, kv_cache_memory=NOMINAL_KV_BYTES_PER_TOKEN * 16 * 50)


def test_bad_runner_and_cost_are_rejected():
    with pytest.raises(ValueError, match="runner must be"):
        create_engine_config(runner="fake")
    with pytest.raises(ValueError, match="step_s must be >= 0"):
        SimulatedCost(step_s=-1)


def test_kv_cache_too_small_for_max_model_len_is_a_clear_error():
    with pytest.raises(ValueError, match=r"room for 8 blocks.*max_model_len \(256\).*needs 17"):
        make_engine(max_model_len=256, block_size=16, num_blocks=8)
    assert make_engine(max_model_len=256, block_size=16, num_blocks=17).scheduler is not None


@pytest.mark.parametrize("ends_by", ["finishing", "abort"])
def test_the_runner_forgets_the_last_request_once_the_engine_goes_idle(ends_by):
    """vLLM's has_requests counts finished requests the runner has not been told of: the engine
    steps once more, carrying their ids, so no state (nor decode KV row) outlives them."""
    engine = make_engine(max_model_len=64)
    engine.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_id=2))
    engine.step()
    if ends_by == "abort":
        engine.abort_requests(["r"])
    while engine.scheduler.has_requests():
        engine.step()
    assert engine.scheduler.requests == {}
    assert engine.model_runner.requests == {}
