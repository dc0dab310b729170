"""Structured outputs after the reasoning (--reasoning-parser;
minicore/structured_output/reasoning.py): where a request's reasoning ends, from its prompt and
from its tokens' text, a tag split across tokens and steps, drafts that cross it; and on the real
default model in float32, a grammar that leaves the reasoning free and constrains what follows
</think>, the same with drafts, async scheduling and both, everywhere with enable_in_reasoning or
without a parser, and from the start where the prompt ended the reasoning."""

import re

import pytest
from test_structured_output_engine import assert_idle

from minicore.config import create_engine_config
from minicore.llm import LLM
from minicore.sampling_params import SamplingParams, StructuredOutputsParams
from minicore.structured_output.reasoning import ReasoningEnd, ReasoningGate

PIECES = {1: "Let", 2: " me", 3: " think", 4: ".</", 5: "think", 6: ">{", 7: '"a', 8: "</think>"}


class PieceTokenizer:
    def decode(self, token_ids: list[int]) -> str:
        return "".join(PIECES[t] for t in token_ids)


def gate() -> ReasoningGate:
    return ReasoningGate(PieceTokenizer(), "<think>", "</think>")


@pytest.mark.parametrize("prompt, ended", [
    ([1, 2], False),  # no tags: the reasoning is the output's until it closes it (deepseek_r1)
    ([8], True),
    ([4, 5, 6, 7], True),  # the end tag in pieces
    ([8, 1], True),
])
def test_the_prompt_says_whether_the_reasoning_has_ended(prompt, ended):
    assert gate().for_request(prompt).ended is ended


def test_an_end_tag_split_across_tokens_and_steps():
    reasoning = gate().for_request([1])
    assert reasoning.consume([2, 3]) == 2 and not reasoning.ended
    assert reasoning.consume([4]) == 1 and not reasoning.ended  # ".</" waits for the rest
    assert reasoning.consume([5, 6, 7]) == 2 and reasoning.ended  # ">{" closes it
    assert reasoning.consume([7]) == 0  # all the grammar's from now on


def test_drafts_leave_free_the_positions_up_to_the_end_tag():
    reasoning = gate().for_request([1])
    assert reasoning.num_free([2, 3]) == 3  # no end: each position, and the bonus one, free
    assert reasoning.num_free([4, 5, 6, 7]) == 3  # the grammar starts after ">{"
    assert reasoning.num_free([8, 7]) == 1
    assert reasoning.num_free([]) == 1
    assert not reasoning.ended and reasoning.tail == "Let"  # looking ahead changes nothing
    reasoning.consume([8])
    assert reasoning.num_free([7, 7]) == 0


def test_an_ended_reasoning_frees_nothing():
    assert ReasoningEnd("</think>", str, ended=True).num_free([1, 2]) == 0


def test_the_engine_flag_goes_to_the_structured_outputs_config():
    config = create_engine_config(reasoning_parser="qwen3")
    assert config.structured_outputs_config.reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="'nope' is not a reasoning parser; they are "
                                         "deepseek_r1, qwen3"):
        create_engine_config(structured_outputs_config={"reasoning_parser": "nope"})


# The default model, shown the pattern twice, thinks " think." and closes the tag by itself.
THINKING = ('Q: colour? <think>Let me think.</think>{"colour": "red"}\n'
            'Q: colour? <think>Let me think.</think>{"colour": "blue"}\nQ: colour? <think>Let me')
ENDED = 'Q: colour? <think>Let me think.</think>'
ANSWER = r'\{"colour": "(red|blue)"\}'
ENGINE_ARGS = {"max_model_len": 512, "max_num_seqs": 8, "kv_cache_memory": 64 << 20}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


def _texts(model, tokenizer, **kwargs) -> list[str]:
    llm = LLM(model, tokenizer=tokenizer, **ENGINE_ARGS, **kwargs)
    params = SamplingParams(max_tokens=30, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(regex=ANSWER))
    texts = [o.outputs[0].text for o in llm.generate([THINKING, ENDED], params, use_tqdm=False)]
    assert_idle(llm)
    return texts


@pytest.mark.model
def test_the_grammar_constrains_what_follows_the_reasoning(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    free = LLM(model, tokenizer=tokenizer, **ENGINE_ARGS).generate(
        [THINKING], SamplingParams(max_tokens=30, temperature=0.0), use_tqdm=False)
    thought = free[0].outputs[0].text.split("</think>")[0] + "</think>"
    assert thought == " think.</think>"
    gated = _texts(model, tokenizer, reasoning_parser="deepseek_r1")
    assert gated[0].startswith(thought) and re.fullmatch(ANSWER, gated[0][len(thought):])
    assert re.fullmatch(ANSWER, gated[1])  # its prompt ended the reasoning
    for whole in (_texts(model, tokenizer), _texts(model, tokenizer, structured_outputs_config={
            "reasoning_parser": "qwen3", "enable_in_reasoning": True})):
        assert all(re.fullmatch(ANSWER, text) for text in whole)
    for mode in ({"speculative_config": NGRAM}, {"async_scheduling": True},
                 {"speculative_config": NGRAM, "async_scheduling": True}):
        assert _texts(model, tokenizer, reasoning_parser="deepseek_r1", **mode) == gated, mode
