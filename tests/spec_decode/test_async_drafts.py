"""Drafts with async scheduling end to end, on the default model in float32: the runner proposes
each request's ngram drafts right after it samples (minicore/model/async_spec_decode.py) and
verifies them in the step the scheduler scheduled meanwhile with placeholders. Greedy output
equals greedy output one step at a time without drafts, token for token (stops, max_tokens up to
max_model_len, preemptions with a step in flight, disable_by_batch_size); the drafts proposed and
accepted are those of drafts without async scheduling, so seeded sampling draws the same tokens
too; and a served engine (`serve --async-scheduling --speculative-config`) gives the offline text
and counts its drafts in /metrics. An abort with drafts in flight:
tests/engine/test_async_scheduling.py."""

import json

import httpx
import pytest
from server_helpers import ServerProcess
from test_spec_decode_e2e import GREEDY, PROMPTS, SPEC, completions, spec_counters

from minicore.llm import LLM
from minicore.model.async_spec_decode import AsyncSpecDecodeSampler
from minicore.sampling_params import SamplingParams
from minicore.spec_decode.drafter import NoDrafter

pytestmark = pytest.mark.model

ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory": 64 << 20}


def make_llm(hf_model_and_tokenizer, **kwargs) -> LLM:
    model, tokenizer = hf_model_and_tokenizer
    return LLM(model, tokenizer=tokenizer, **{**ENGINE_ARGS, **kwargs})


@pytest.fixture(scope="module")
def llms(hf_model_and_tokenizer) -> dict[str, LLM]:
    return {"plain": make_llm(hf_model_and_tokenizer),
            "drafts": make_llm(hf_model_and_tokenizer, speculative_config=SPEC),
            "async+drafts": make_llm(hf_model_and_tokenizer, speculative_config=SPEC,
                                     async_scheduling=True)}


def stats(llm: LLM) -> tuple[int, int, int, list[int]]:
    s = llm.llm_engine.scheduler.spec_decode.stats
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
            list(s.num_accepted_tokens_per_pos))


def test_the_runner_drafts_and_the_engine_does_not(llms):
    engine = llms["async+drafts"].llm_engine
    assert engine.step_fn == engine.step_with_batch_queue
    assert isinstance(engine.drafter, NoDrafter)
    assert isinstance(engine.model_runner.sample_step, AsyncSpecDecodeSampler)


@pytest.mark.parametrize("params", [
    GREEDY,
    [SamplingParams(max_tokens=32, temperature=0, stop=["lamp"]),
     SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[13]), GREEDY],
    [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 5, 7)],
    SamplingParams(max_tokens=24, temperature=0, logprobs=2),
], ids=["greedy", "stops", "max_tokens", "logprobs"])
def test_greedy_equals_one_step_at_a_time_without_drafts(llms, params):
    before = stats(llms["async+drafts"])
    got = completions(llms["async+drafts"], params)
    assert got == completions(llms["drafts"], params)
    expected = completions(llms["plain"], params)
    # Stop strings may leave the token ids running on within the step that found them, with
    # drafts as without async scheduling (test_spec_decode_e2e.py): the text is the same.
    assert [[c[1:] for c in o] for o in got] == [[c[1:] for c in o] for o in expected]
    assert stats(llms["async+drafts"])[2] > before[2]  # drafts were accepted


def test_the_same_drafts_are_proposed_and_accepted_as_without_async_scheduling(llms):
    before = {name: stats(llms[name]) for name in ("drafts", "async+drafts")}
    for name in before:
        completions(llms[name], GREEDY)
    grown = {name: [a - b if isinstance(a, int) else [x - y for x, y in zip(a, b)]
                    for a, b in zip(stats(llms[name]), before[name])] for name in before}
    assert grown["async+drafts"] == grown["drafts"] and grown["drafts"][2] > 0


def test_seeded_sampling_draws_what_drafts_without_async_scheduling_draw(llms):
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=3, n=2)
    assert completions(llms["async+drafts"], params) == completions(llms["drafts"], params)


def test_requests_that_run_to_max_model_len(hf_model_and_tokenizer, llms):
    """Near max_model_len the placeholders are cut so that no draft reaches its last position,
    counted from a computed count that runs ahead by the drafts in flight."""
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    short = make_llm(hf_model_and_tokenizer, max_model_len=96, speculative_config=SPEC,
                     async_scheduling=True)
    prompts = [p[:200] for p in PROMPTS]
    expected = completions(make_llm(hf_model_and_tokenizer, max_model_len=96), params, prompts)
    assert completions(short, params, prompts) == expected
    assert all(c[0][2] == "length" for c in expected)


def test_preemptions_with_drafts_in_flight_change_no_output(hf_model_and_tokenizer):
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    # 12 usable blocks of 16 tokens for three growing requests: they preempt each other.
    cramped = {"num_blocks": 13, "max_model_len": 160}
    prompts = [p[:150] for p in PROMPTS]
    expected = completions(make_llm(hf_model_and_tokenizer, **cramped), params, prompts)
    llm = make_llm(hf_model_and_tokenizer, speculative_config=SPEC, async_scheduling=True,
                   **cramped)
    assert completions(llm, params, prompts) == expected
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.kv_cache_manager.usage == 0


def test_served_with_drafts_and_async_scheduling(llms):
    expected = [c[0][1] for c in completions(llms["plain"], GREEDY)]
    with ServerProcess("--max-model-len", "512", "--kv-cache-memory", str(64 << 20),
                       "--async-scheduling", "--speculative-config", json.dumps(SPEC)) as server:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            response = http.post("/v1/completions", json={
                "prompt": PROMPTS, "max_tokens": GREEDY.max_tokens, "temperature": 0})
            assert response.status_code == 200, response.text
            choices = sorted(response.json()["choices"], key=lambda c: c["index"])
            assert [c["text"] for c in choices] == expected
            counters = spec_counters(http.get("/metrics").text)
    accepted = counters["vllm:spec_decode_num_accepted_tokens_total", None]
    assert 0 < accepted <= counters["vllm:spec_decode_num_draft_tokens_total", None]


def test_disable_by_batch_size_holds_the_drafts_back_while_the_batch_is_large(
        hf_model_and_tokenizer, llms):
    """Three requests with disable_by_batch_size 3: no drafts until the shortest finishes."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 24, 32)]
    llm = make_llm(hf_model_and_tokenizer, async_scheduling=True,
                   speculative_config={**SPEC, "disable_by_batch_size": 3})
    assert completions(llm, params) == completions(llms["plain"], params)
    drafts = llm.llm_engine.scheduler.spec_decode.stats.num_drafts
    unlimited = stats(llms["async+drafts"])[0]
    completions(llms["async+drafts"], params)
    assert 0 < drafts < stats(llms["async+drafts"])[0] - unlimited
