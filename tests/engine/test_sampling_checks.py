"""The InputProcessor's sampling checks with a stub tokenizer: bad_words become token ids (with
and without a leading space, as vLLM's update_from_tokenizer), truncate_prompt_tokens keeps the
last tokens, add_special_tokens reaches the tokenizer, token ids and logprobs are bounded, the
simulated runner refuses logprobs; and the engine re-checks what it decodes (FinishReason.ERROR
path: EngineCore.add_request raises ValueError)."""

import pytest

from minicore.config import create_engine_config
from minicore.engine.components import make_engine_core
from minicore.engine.input_processor import InputProcessor, InvalidRequestError
from minicore.request import Request
from minicore.sampling_params import SamplingParams

VOCAB = 1000


class WordTokenizer:
    """One token per character (ids 100+), a space joined to the character after it (ids 900+),
    a BOS (1) when special tokens are added."""
    eos_token_id = 2

    def encode(self, text, add_special_tokens=True):
        ids = [1] if add_special_tokens else []
        for i, c in enumerate(text):
            if c != " ":
                ids.append(900 + ord(c) % 100 if i and text[i - 1] == " " else 100 + ord(c) % 800)
        return ids


def processor(**engine_args) -> InputProcessor:
    return InputProcessor(create_engine_config(max_model_len=64, **engine_args), WordTokenizer(),
                          VOCAB)


def test_text_prompts_get_special_tokens_unless_told_not_to():
    assert processor().process_inputs("a", "hi", SamplingParams()).prompt_token_ids[0] == 1
    request = processor().process_inputs("b", "hi", SamplingParams(), add_special_tokens=False)
    assert request.prompt_token_ids == WordTokenizer().encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("request_id", [None, 7, b"r"])
def test_a_request_id_that_is_not_a_string_is_refused(request_id):
    # The engine would drop its ADD as malformed, and the caller would wait forever.
    with pytest.raises(InvalidRequestError, match="request_id must be a string") as e:
        processor().process_inputs(request_id, [5], SamplingParams())
    assert e.value.param == "request_id"


def test_truncate_prompt_tokens_keeps_the_last_ones():
    params = SamplingParams(truncate_prompt_tokens=2)
    assert processor().process_inputs("t", [5, 6, 7, 8], params).prompt_token_ids == [7, 8]
    params = SamplingParams(truncate_prompt_tokens=-1)
    assert processor().process_inputs("t", [5, 6, 7], params).prompt_token_ids == [5, 6, 7]


def test_bad_words_become_token_ids_with_and_without_a_space():
    params = SamplingParams(bad_words=["ab", " c"])
    request = processor().process_inputs("w", [5], params)
    encode = WordTokenizer().encode
    assert request.sampling_params.bad_words_token_ids == [
        encode("ab", False), encode(" ab", False), encode("c", False), encode(" c", False)]
    assert encode(" ab", False)[0] != encode("ab", False)[0]
    assert params.bad_words_token_ids is None  # the caller's params are left alone


@pytest.mark.parametrize("field, params", [
    ("logit_bias", SamplingParams(logit_bias={VOCAB: 1.0})),
    ("allowed_token_ids", SamplingParams(allowed_token_ids=[VOCAB + 5])),
    ("stop_token_ids", SamplingParams(stop_token_ids=[VOCAB])),
    ("logprobs", SamplingParams(logprobs=21)),
    ("logprobs", SamplingParams(logprobs=-1)),
    ("prompt_logprobs", SamplingParams(prompt_logprobs=50)),
    ("truncate_prompt_tokens", SamplingParams(truncate_prompt_tokens=65)),
])
def test_out_of_bounds_is_refused_naming_the_field(field, params):
    with pytest.raises(InvalidRequestError) as ei:
        processor().process_inputs("x", [5], params)
    assert ei.value.param == field


def test_max_logprobs_bounds_and_minus_one_lifts_the_bound():
    assert processor(max_logprobs=50).process_inputs("x", [5], SamplingParams(logprobs=50))
    assert processor(max_logprobs=-1).process_inputs("x", [5], SamplingParams(logprobs=-1))


def test_the_simulated_runner_refuses_logprobs_in_the_frontend_and_the_engine():
    with pytest.raises(InvalidRequestError, match="simulated") as ei:
        processor(runner="simulated").process_inputs("s", [5], SamplingParams(prompt_logprobs=0))
    assert ei.value.param == "prompt_logprobs"
    engine = make_engine_core(create_engine_config(runner="simulated", max_model_len=64,
                                                   num_blocks=64))
    with pytest.raises(ValueError, match="simulated"):
        engine.add_request(Request("s", [5], SamplingParams(logprobs=1)))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(Request("v", [5], SamplingParams(logit_bias={10**7: 1.0})))
    assert not engine.scheduler.has_unfinished_requests()
