"""Structured outputs in the engine core on the real default model: every kind of constraint
(a JSON schema, json_object, a regex, choices, an EBNF grammar) is obeyed, with n > 1, logprobs,
prefix caching and preemption; a request whose grammar fails in the engine ends alone with an
error; a bad constraint is refused before it reaches the engine; a runner without logits
refuses them, saying why."""

import json
import re
import threading
import time

import jsonschema
import pytest

from minicore.engine.core import EngineCore
from minicore.engine.input_processor import InvalidRequestError
from minicore.llm import LLM
from minicore.request import FinishReason, Request, RequestStatus
from minicore.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.model

ENGINE_ARGS = {"max_model_len": 512, "max_num_seqs": 8, "kv_cache_memory": 64 << 20}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                  "maxItems": 2}},
          "required": ["name", "age", "colour", "tags"], "additionalProperties": False}
PROMPT = ("You are a helpful assistant. Describe one person as a JSON object with their name, "
          "age, favourite colour and at most two tags:")


def structured(max_tokens=96, **constraint) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                          structured_outputs=StructuredOutputsParams(**constraint))


@pytest.fixture(scope="module")
def llm(hf_model_and_tokenizer) -> LLM:
    model, tokenizer = hf_model_and_tokenizer
    return LLM(model, tokenizer=tokenizer, **ENGINE_ARGS)


def texts(llm: LLM, prompts, params) -> list[str]:
    return [c.text for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def assert_idle(llm: LLM) -> None:
    scheduler = llm.llm_engine.scheduler
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert scheduler.kv_cache_manager.usage == 0


def test_json_schema_outputs_validate_with_n_samples_and_logprobs(llm):
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=3, n=3, logprobs=2,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len({c.text for c in output.outputs}) > 1  # sampled, not one greedy answer thrice
    for completion in output.outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)
        # The chosen token's logprob is of the masked distribution: always finite.
        assert all(lp[t].logprob > float("-inf")
                   for t, lp in zip(completion.token_ids, completion.logprobs))
    assert_idle(llm)


def test_json_object_regex_choice_and_grammar_are_obeyed(llm):
    prompts = ["Give me a JSON object about cats:", "My phone number is",
               "Is the sky blue? Answer:", "Count from one:"]
    params = [structured(json_object=True, max_tokens=64),
              structured(regex=r"\(\d{3}\) \d{3}-\d{4}"),
              structured(choice=["yes", "no", "maybe"]),
              structured(grammar='root ::= "one" (", " number){2}\nnumber ::= "two" | "three"')]
    obj, phone, answer, counted = texts(llm, prompts, params)
    assert isinstance(json.loads(obj), dict)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone)
    assert answer in ("yes", "no", "maybe")
    assert re.fullmatch(r"one(, (two|three)){2}", counted)
    assert_idle(llm)


def test_structured_and_plain_requests_share_a_batch(llm):
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = texts(llm, ["The capital of France is"], plain)
    mixed = texts(llm, ["The capital of France is", "Is water wet? Answer:"],
                  [plain, structured(choice=["yes", "no"])])
    assert mixed[0] == alone[0] and mixed[1] in ("yes", "no")


def test_prefix_caching_and_preemption_keep_the_outputs(hf_model_and_tokenizer, llm):
    params = structured(json=PERSON)
    reference = texts(llm, [PROMPT], params)[0]
    model, tokenizer = hf_model_and_tokenizer
    # 8 usable blocks of 16 tokens: three such requests cannot all hold their KV at once.
    small = LLM(model, tokenizer=tokenizer, max_model_len=128, max_num_seqs=3, num_blocks=9)
    outputs = texts(small, [PROMPT] * 3, params)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert outputs == [reference] * 3
    again = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].text == reference


@pytest.mark.parametrize("constraint, message", [
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
     "invalid structured_outputs.json"),
    ({"json": "{not json"}, "invalid structured_outputs.json"),
    ({"regex": "(unclosed"}, "invalid structured_outputs.regex"),
    ({"grammar": "root ::= missing_rule"}, "invalid structured_outputs.grammar"),
    ({"grammar": "  "}, "structured_outputs.grammar cannot be an empty string"),
    ({"json_object": False}, "structured_outputs.json_object must be true"),
])
def test_a_bad_constraint_is_refused_before_the_engine(llm, constraint, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as e:
        llm.generate(["x"], structured(**constraint), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert_idle(llm)
    assert texts(llm, ["Yes or no?"], structured(choice=["yes", "no"]))[0] in ("yes", "no")


def run_engine(engine: EngineCore, timeout_s: float = 60) -> dict:
    """Step until idle (steps run nothing while grammars compile); each request's final
    output."""
    finished, deadline = {}, time.monotonic() + timeout_s
    while engine.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise AssertionError("the engine did not finish its requests")
        for output in engine.step_fn()[0]:
            if output.finish_reason is not None:
                finished[output.request_id] = output
    return finished


def test_a_grammar_that_fails_in_the_engine_ends_that_request_alone(llm):
    engine = llm.llm_engine
    bad = structured(grammar="root ::= undefined_rule")  # passed no frontend check
    engine.add_request(Request("bad", [1, 2, 3], bad, eos_token_id=llm.tokenizer.eos_token_id))
    engine.add_request(Request("good", [1, 2, 3], structured(choice=["yes", "no"]),
                               eos_token_id=llm.tokenizer.eos_token_id))
    finished = run_engine(engine)
    assert finished["bad"].finish_reason == FinishReason.ERROR
    assert "invalid structured_outputs.grammar" in finished["bad"].error_message
    assert finished["good"].finish_reason == FinishReason.STOP
    assert_idle(llm)


def test_a_request_that_goes_on_past_its_grammar_is_unconstrained_from_there(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes"]))
    (output,) = llm.generate(["Yes?"], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 6
    assert completion.text.startswith("yes")
    assert_idle(llm)


def test_an_abort_while_the_grammar_compiles_leaves_nothing(llm):
    engine = llm.llm_engine
    engine.add_request(Request("a", [1, 2, 3], structured(json=PERSON), eos_token_id=0))
    assert engine.scheduler.requests["a"].status == RequestStatus.WAITING_FOR_FSM
    engine.abort_requests(["a"])
    assert run_engine(engine) == {}
    assert_idle(llm)


def test_a_compile_whose_request_left_is_dropped_and_holds_nothing_back(llm):
    """Small grammars compile one at a time: one queued for a request aborted meanwhile (its client
    left) is cancelled, so that the next request's grammar is not kept waiting behind it."""
    engine = llm.llm_engine
    manager = engine.structured_output_manager
    gate = threading.Event()
    manager.executor_small.submit(gate.wait, 30)  # the small grammars' thread, busy
    engine.add_request(Request("left", [1, 2, 3], structured(json={
        "type": "object", "properties": {"left": {"type": "integer"}}}), eos_token_id=0))
    engine.add_request(Request("stays", [1, 2, 3], structured(max_tokens=4, choice=["x", "y"]),
                                eos_token_id=0))
    left = engine.scheduler.requests["left"].structured_output_request.compiled
    engine.abort_requests(["left"])
    engine.step_fn()
    assert left.cancelled()
    gate.set()
    assert set(run_engine(engine)) == {"stays"}
    assert_idle(llm)


def test_a_runner_without_logits_refuses_them_naming_the_reason():
    """Async scheduling and drafts run them (test_grammar_async_and_drafts.py); the simulated
    runner, which has no logits to mask, refuses them at the frontend and at the engine."""
    from minicore.config import create_engine_config
    from minicore.engine.components import make_engine_core
    from minicore.engine.input_processor import InputProcessor

    config = create_engine_config(runner="simulated", max_model_len=256)
    reason = "not supported with a runner without logits"
    with pytest.raises(InvalidRequestError, match=reason):
        InputProcessor(config, None, 256).process_inputs("r", [1, 2], structured(choice=["a"]))
    engine = make_engine_core(config)
    with pytest.raises(ValueError, match=reason):
        engine.add_request(Request("r", [1, 2], structured(choice=["a"]), eos_token_id=0))
    assert not engine.scheduler.requests
    engine.shutdown()


def test_the_structured_outputs_config_is_read(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    compact = LLM(model, tokenizer=tokenizer, **ENGINE_ARGS,
                  structured_outputs_config={"backend": "xgrammar",
                                             "disable_any_whitespace": True})
    text = texts(compact, [PROMPT], structured(json=PERSON))[0]
    jsonschema.validate(json.loads(text), PERSON)
    assert not re.search(r"[,:{\[]\s", text)
