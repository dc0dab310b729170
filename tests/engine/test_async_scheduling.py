"""Async scheduling end to end on the real default model: with the batch queue (the next step
scheduled while the forward of this one runs), every output equals the one of an engine that
steps one at a time, token for token, with stops, max_tokens, min_tokens, logprobs, n > 1 and
prefix caching; aborts (with drafts in flight too) and preemptions with a step in flight leave
no output behind and no block held; and the engine process (AsyncLLM) streams the same tokens and
survives an abort mid-stream.
"""

import asyncio

import pytest

from minicore.config import create_engine_config
from minicore.engine.async_llm import AsyncLLM
from minicore.engine.components import make_engine_core
from minicore.llm import LLM
from minicore.request import Request
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

ENGINE_ARGS = {"max_model_len": 256, "max_num_seqs": 8, "kv_cache_memory": 64 << 20}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "List three colours:", "The quick brown fox"]


def make_llm(hf_model_and_tokenizer, async_scheduling: bool, **kwargs) -> LLM:
    model, tokenizer = hf_model_and_tokenizer
    return LLM(model, tokenizer=tokenizer, async_scheduling=async_scheduling,
               **{**ENGINE_ARGS, **kwargs})


def completions(llm: LLM, params) -> list[list[tuple]]:
    return [[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted(p) for p in c.logprobs])
             for c in o.outputs]
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llms(hf_model_and_tokenizer) -> dict[bool, LLM]:
    return {a: make_llm(hf_model_and_tokenizer, a) for a in (False, True)}


def test_the_async_engine_runs_the_batch_queue(llms):
    assert llms[True].llm_engine.batch_queue.size == 2
    assert llms[True].llm_engine.step_fn == llms[True].llm_engine.step_with_batch_queue
    assert llms[False].llm_engine.step_fn == llms[False].llm_engine.step


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0),
    # A stop string, a stop id and an EOS end requests while their next step is in flight.
    SamplingParams(max_tokens=40, temperature=0, stop=["\n"], stop_token_ids=[13]),
    SamplingParams(max_tokens=12, temperature=0, min_tokens=8, logprobs=2),
    SamplingParams(max_tokens=16, temperature=0.9, seed=7, n=3),
], ids=["greedy", "stops", "min_tokens-logprobs", "seeded-n3"])
def test_outputs_equal_those_of_one_step_at_a_time(llms, params):
    expected = completions(llms[False], params)
    assert completions(llms[True], params) == expected


def test_prefix_caching_hits_the_same_with_a_step_in_flight(llms):
    params = SamplingParams(max_tokens=8, temperature=0)
    shared = "Here is a long shared preamble that both requests start with, word for word. " * 2
    cached = {}
    for a, llm in llms.items():
        llm.generate([shared + "First:"], params, use_tqdm=False)
        second = llm.generate([shared + "Second:"], params, use_tqdm=False)[0]
        cached[a] = (second.num_cached_tokens, list(second.outputs[0].token_ids))
    assert cached[True] == cached[False] and cached[True][0] >= 16


def test_preemptions_with_a_step_in_flight_change_no_output(hf_model_and_tokenizer):
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    # 12 usable blocks of 16 tokens: five growing requests preempt each other.
    results, preemptions = {}, {}
    for a in (False, True):
        llm = make_llm(hf_model_and_tokenizer, a, num_blocks=13, max_model_len=128)
        results[a] = completions(llm, params)
        preemptions[a] = llm.llm_engine.scheduler.num_preemptions
        assert llm.llm_engine.scheduler.kv_cache_manager.usage == 0
    assert preemptions[True] > 0 and preemptions[False] > 0
    assert results[True] == results[False]


@pytest.mark.parametrize("drafts", [None, {"method": "ngram", "num_speculative_tokens": 3}],
                         ids=["plain", "with-drafts"])
def test_an_abort_with_a_step_in_flight_gives_no_output_and_frees_its_blocks(
        hf_model_and_tokenizer, drafts):
    model, tokenizer = hf_model_and_tokenizer
    config = create_engine_config(async_scheduling=True, speculative_config=drafts,
                                  **ENGINE_ARGS)
    engine = make_engine_core(config, model, tokenizer)
    ids = tokenizer(PROMPTS[0]).input_ids
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for name in "ab":
        engine.add_request(Request(name, ids, params))
    tokens: dict[str, list[int]] = {"a": [], "b": []}

    def step():
        outputs, _ = engine.step_fn()
        for output in outputs:
            tokens[output.request_id].extend(output.new_token_ids)

    for _ in range(4):
        step()
    assert engine.batch_queue.has_pending()  # a step that runs a and b is in flight
    # With drafts, it verifies a's placeholder drafts too.
    assert engine.scheduler.requests["a"].num_output_placeholders == (4 if drafts else 1)
    engine.abort_requests(["a"])
    num_a = len(tokens["a"])
    while engine.scheduler.has_unfinished_requests():
        step()
    assert len(tokens["a"]) == num_a  # nothing after the abort
    assert len(tokens["b"]) == 20
    assert engine.scheduler.kv_cache_manager.usage == 0 and not engine.scheduler.running
    assert "a" not in engine.model_runner.requests
    # A new request under the aborted one's id gets its own tokens, from its own first step.
    engine.add_request(Request("a", ids, SamplingParams(max_tokens=20, temperature=0,
                                                        ignore_eos=True)))
    tokens["a"] = []
    while engine.scheduler.has_unfinished_requests():
        step()
    assert tokens["a"] == tokens["b"]
    engine.shutdown()


@pytest.mark.asyncio(loop_scope="session")
async def test_the_engine_process_streams_the_same_tokens_and_survives_an_abort(llms):
    params = SamplingParams(max_tokens=24, temperature=0)
    expected = [o.outputs[0].token_ids for o in llms[False].generate(PROMPTS, params,
                                                                     use_tqdm=False)]
    config = create_engine_config(dtype="float32", device="cpu", async_scheduling=True,
                                  **ENGINE_ARGS)
    client = await asyncio.wait_for(AsyncLLM.from_engine_config(config), 180)
    try:
        async def run(i: int, prompt: str):
            return [o async for o in client.generate(prompt, params, f"req-{i}")]

        async def abort_after_two():
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            async for output in client.generate(PROMPTS[0], long, "aborted"):
                if len(output.outputs[0].token_ids) >= 2:
                    await client.abort("aborted")
                    return

        async with asyncio.timeout(120):
            *streams, _ = await asyncio.gather(*(run(i, p) for i, p in enumerate(PROMPTS)),
                                               abort_after_two())
            stats = await client.engine_core.call_utility_async("get_stats")
            while stats["request_ids"] or stats["kv_cache_usage"]:
                await asyncio.sleep(0.05)
                stats = await client.engine_core.call_utility_async("get_stats")
    finally:
        await client.shutdown()
    assert client.engine_core.procs[0].exitcode == 0
    assert [s[-1].outputs[0].token_ids for s in streams] == expected
