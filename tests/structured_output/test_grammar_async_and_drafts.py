"""Structured outputs with async scheduling, with drafts and with both, on the real default model in
float32:
every kind of constraint, beside plain requests, gives the same greedy outputs as one step at a
time without drafts; a step scheduled before a structured token in flight is back waits for its
bitmask (and really is scheduled so); drafts are verified against a row per position, and ones the
grammar refuses are rejected; aborts and shutdown leave nothing waiting."""

import json
import re

import jsonschema
import pytest
from test_structured_output_engine import ENGINE_ARGS, PERSON, PROMPT, assert_idle, structured

from minicore.llm import LLM
from minicore.request import Request
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
# A prompt that repeats the answer's shape, so that ngram drafts propose JSON the grammar allows
# (and, past its keys, text it does not).
REPEATED = ('Records: {"name": "Ann", "age": 31, "colour": "red", "tags": ["a", "b"]} '
            '{"name": "Bob", "age": 42, "colour": "blue", "tags": ["c"]} ' + PROMPT)
PROMPTS = [PROMPT, REPEATED, "Give me a JSON object about cats:", "My phone number is",
           "Is the sky blue? Answer:", "Count from one:", "The capital of France is"]
PARAMS = [structured(json=PERSON), structured(json=PERSON), structured(json_object=True,
                                                                        max_tokens=48),
          structured(regex=r"\(\d{3}\) \d{3}-\d{4}"), structured(choice=["yes", "no", "maybe"]),
          structured(grammar='root ::= "one" (", " number){2}\nnumber ::= "two" | "three"'),
          SamplingParams(max_tokens=24, temperature=0.0)]


def _outputs(llm: LLM) -> list[tuple[str, str]]:
    return [(o.outputs[0].text, o.outputs[0].finish_reason)
            for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(hf_model_and_tokenizer) -> list[tuple[str, str]]:
    model, tokenizer = hf_model_and_tokenizer
    outputs = _outputs(LLM(model, tokenizer=tokenizer, **ENGINE_ARGS))
    person, repeated, obj, phone, answer, counted, _ = (text for text, _ in outputs)
    for text in (person, repeated):
        jsonschema.validate(json.loads(text), PERSON)
    assert isinstance(json.loads(obj), dict)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone)
    assert answer in ("yes", "no", "maybe")
    assert re.fullmatch(r"one(, (two|three)){2}", counted)
    return outputs


def _recording_pending(llm: LLM) -> list[bool]:
    """Whether each step with structured rows was scheduled with its tokens in flight."""
    manager, seen = llm.llm_engine.structured_output_manager, []
    grammar_bitmask = manager.grammar_bitmask

    def record(scheduler_output, requests):
        grammar_bitmask(scheduler_output, requests)
        if scheduler_output.structured_output_request_ids:
            seen.append(scheduler_output.pending_structured_output_tokens)
    manager.grammar_bitmask = record
    return seen


def test_async_scheduling_gives_the_outputs_of_one_step_at_a_time(hf_model_and_tokenizer,
                                                                  reference):
    model, tokenizer = hf_model_and_tokenizer
    llm = LLM(model, tokenizer=tokenizer, async_scheduling=True, **ENGINE_ARGS)
    pending = _recording_pending(llm)
    assert _outputs(llm) == reference
    # Decodes were scheduled before their previous token was back, and waited for their bitmask.
    assert sum(pending) > 20 and not all(pending)
    assert not llm.llm_engine.structured_output_manager._pending
    assert_idle(llm)


def test_drafts_give_the_outputs_without_drafts_and_are_verified_per_position(
        hf_model_and_tokenizer, reference):
    model, tokenizer = hf_model_and_tokenizer
    llm = LLM(model, tokenizer=tokenizer, speculative_config=NGRAM, **ENGINE_ARGS)
    drafted = []
    fill = llm.llm_engine.structured_output_manager._fill

    def record(scheduler_output, scheduled):
        fill(scheduler_output, scheduled)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for req_id, first in scheduler_output.structured_output_request_ids.items():
            if drafts.get(req_id):
                drafted.append(scheduler_output.grammar_bitmask[first:first + len(drafts[req_id])
                                                                + 1].clone())
    llm.llm_engine.structured_output_manager._fill = record
    assert _outputs(llm) == reference
    stats = llm.llm_engine.scheduler.spec_decode.stats
    assert stats.num_accepted_tokens > 0
    # Some structured requests verified drafts, each position against its own row: rows differ.
    assert drafted and any(not (rows == rows[0]).all() for rows in drafted if len(rows) > 1)
    assert_idle(llm)


def test_async_scheduling_with_drafts_gives_the_outputs_of_one_step_at_a_time(
        hf_model_and_tokenizer, reference):
    """The runner proposes the drafts as it samples; a structured request's rows for them are
    filled from its proposals, sent back with the token they follow."""
    model, tokenizer = hf_model_and_tokenizer
    llm = LLM(model, tokenizer=tokenizer, async_scheduling=True, speculative_config=NGRAM,
              **ENGINE_ARGS)
    manager = llm.llm_engine.structured_output_manager
    fill, filled = manager._fill, []

    def record(scheduler_output, scheduled):
        fill(scheduler_output, scheduled)
        for req_id in scheduler_output.structured_output_request_ids:
            if proposals := scheduled[req_id].structured_output_request.proposals:
                filled.append(proposals)
    manager._fill = record
    assert _outputs(llm) == reference
    assert filled and not manager._pending
    assert_idle(llm)
    # The structured requests alone propose and accept the drafts they do without async
    # scheduling.
    sync = LLM(model, tokenizer=tokenizer, speculative_config=NGRAM, **ENGINE_ARGS)
    counts = []
    for engine in (llm, sync):
        stats = engine.llm_engine.scheduler.spec_decode.stats
        before = (stats.num_draft_tokens, stats.num_accepted_tokens)
        engine.generate(PROMPTS[:-1], PARAMS[:-1], use_tqdm=False)
        counts.append((stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]))
    assert counts[0] == counts[1] and counts[0][1] > 0


def test_a_draft_the_grammar_refuses_is_rejected(hf_model_and_tokenizer):
    """Every draft forced to be words no choice has: the output is one of the choices all the
    same, and no draft was accepted."""
    model, tokenizer = hf_model_and_tokenizer
    llm = LLM(model, tokenizer=tokenizer, speculative_config=NGRAM, **ENGINE_ARGS)
    engine = llm.llm_engine
    refused = tokenizer.encode(" banana banana banana", add_special_tokens=False)[:3]
    engine.drafter.propose_for = lambda request: refused
    (output,) = llm.generate(["Is the sky blue? Answer:"],
                             structured(choice=["yes", "no", "maybe"], max_tokens=8),
                             use_tqdm=False)
    assert output.outputs[0].text in ("yes", "no", "maybe")
    stats = engine.scheduler.spec_decode.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0
    assert_idle(llm)


def _pending_step(engine, manager):
    """Step until the structured requests decode, then schedule and submit one more step while
    the previous one is in flight, as the busy loop does before it awaits that one: its bitmask
    waits for the token in flight."""
    while not any(r.num_output_placeholders for r in engine.scheduler.running):
        engine.step_fn()
    executed = engine._submit_next_batch()
    assert len(manager._pending) == 1
    return executed


def test_an_abort_with_a_pending_bitmask_and_shutdown_leave_nothing_waiting(
        hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    llm = LLM(model, tokenizer=tokenizer, async_scheduling=True, **ENGINE_ARGS)
    engine = llm.llm_engine
    manager = engine.structured_output_manager
    engine.add_request(Request("gone", [1, 2, 3], structured(json=PERSON), eos_token_id=0))
    engine.add_request(Request("stays", [1, 2, 3], structured(choice=["x", "y"]),
                               eos_token_id=0))
    executed = _pending_step(engine, manager)
    engine.abort_requests(["gone"])  # a client gone while the loop awaits the step in flight
    future, scheduler_output = engine.batch_queue.take_finished(executed)
    engine.update_from_output(scheduler_output, future.result(timeout=30))
    assert not manager._pending
    finished = {}
    while engine.scheduler.has_requests() or engine.batch_queue.has_pending():
        for output in engine.step_fn()[0]:
            if output.finish_reason is not None:
                finished[output.request_id] = output
    assert list(finished) == ["stays"] and finished["stays"].new_token_ids
    assert_idle(llm)
    # A step whose bitmask waits on a token that never comes back: shutdown releases its forward.
    engine.add_request(Request("last", [1, 2, 3], structured(json=PERSON), eos_token_id=0))
    _pending_step(engine, manager)
    waiting = engine.batch_queue._queue[0][0]  # the newest step's future
    manager.shutdown()
    assert waiting.result(timeout=30) is not None and not manager._pending
