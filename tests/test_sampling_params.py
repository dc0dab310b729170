"""SamplingParams: the defaults, the accepted edge values, and a ValueError naming the field for
every invalid value (wrong range or wrong type)."""

import pytest

from minicore.sampling_params import SamplingParams


def test_defaults():
    sp = SamplingParams()
    assert sp.max_tokens == 16
    assert sp.temperature == 1.0
    assert sp.top_p == 1.0
    assert sp.top_k == 0
    assert sp.seed is None
    assert list(sp.stop_token_ids) == []
    assert sp.ignore_eos is False
    assert sp.min_tokens == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": None},
        {"max_tokens": 1},
        {"temperature": 0.0},
        {"temperature": 2.5},
        {"top_p": 1.0},
        {"top_p": 0.01},
        {"top_k": 0},
        {"top_k": 50},
        {"seed": 0},
        {"seed": 1234},
        {"stop_token_ids": [0, 7, 49151]},
        {"ignore_eos": True},
        {"min_tokens": 4, "max_tokens": 4},
        {"min_tokens": 100, "max_tokens": None},
        {"temperature": 1, "top_p": 1},
    ],
)
def test_valid_values_accepted(kwargs):
    sp = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        got = getattr(sp, k)
        assert (list(got) if k == "stop_token_ids" else got) == v


def test_top_k_minus_one_normalised_to_zero():
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": -3}),
        ("max_tokens", {"max_tokens": "16"}),
        ("max_tokens", {"max_tokens": 2.5}),
        ("temperature", {"temperature": -0.01}),
        ("temperature", {"temperature": "hot"}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.01}),
        ("top_p", {"top_p": -0.5}),
        ("top_p", {"top_p": "x"}),
        ("top_k", {"top_k": -2}),
        ("top_k", {"top_k": "5"}),
        ("top_k", {"top_k": 1.5}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
        ("min_tokens", {"min_tokens": "1"}),
        ("stop_token_ids", {"stop_token_ids": ["a"]}),
        ("stop_token_ids", {"stop_token_ids": [1, -1]}),
        ("stop_token_ids", {"stop_token_ids": [1.5]}),
        ("seed", {"seed": "42"}),
        ("seed", {"seed": 1.5}),
    ],
)
def test_invalid_value_raises_naming_field(field, kwargs):
    with pytest.raises(ValueError) as ei:
        SamplingParams(**kwargs)
    assert field in str(ei.value)


def test_new_field_defaults_are_vllms():
    sp = SamplingParams()
    assert (sp.n, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p) == (
        1, 0.0, 0.0, 1.0, 0.0)
    assert (sp.logit_bias, sp.allowed_token_ids, sp.bad_words, sp.bad_words_token_ids) == (
        None, None, None, None)
    assert (sp.logprobs, sp.prompt_logprobs, sp.truncate_prompt_tokens) == (None, None, None)
    assert (sp.include_stop_str_in_output, sp.skip_special_tokens,
            sp.spaces_between_special_tokens) == (False, True, True)


@pytest.mark.parametrize("kwargs", [
    {"n": 3}, {"presence_penalty": -2.0}, {"presence_penalty": 2}, {"frequency_penalty": 1.5},
    {"repetition_penalty": 0.01}, {"repetition_penalty": 3.0}, {"min_p": 0.0}, {"min_p": 1.0},
    {"logprobs": 0}, {"logprobs": 20}, {"logprobs": -1}, {"prompt_logprobs": 0},
    {"prompt_logprobs": -1}, {"allowed_token_ids": [0, 5]}, {"bad_words": ["x", "y z"]},
    {"truncate_prompt_tokens": 1}, {"truncate_prompt_tokens": -1},
    {"include_stop_str_in_output": True}, {"skip_special_tokens": False},
    {"spaces_between_special_tokens": False}, {"bad_words_token_ids": [[1], [2, 3]]},
])
def test_new_valid_values_accepted(kwargs):
    sp = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(sp, k) == v


def test_logit_bias_keys_parsed_and_values_clamped():
    sp = SamplingParams(logit_bias={"7": 250, 3: -1000.0, 4: 0.5})
    assert sp.logit_bias == {7: 100.0, 3: -100.0, 4: 0.5}


def test_logprobs_true_means_one_and_bad_words_deduplicated():
    sp = SamplingParams(logprobs=True, prompt_logprobs=True, bad_words=["a", "b", "a"])
    assert (sp.logprobs, sp.prompt_logprobs, sp.bad_words) == (1, 1, ["a", "b"])


@pytest.mark.parametrize("field, kwargs", [
    ("n", {"n": 0}), ("n", {"n": 2, "temperature": 0.0}), ("n", {"n": "2"}),
    ("presence_penalty", {"presence_penalty": 2.01}),
    ("presence_penalty", {"presence_penalty": "x"}),
    ("frequency_penalty", {"frequency_penalty": -2.5}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": float("inf")}),
    ("min_p", {"min_p": -0.1}), ("min_p", {"min_p": 1.5}),
    ("logprobs", {"logprobs": -2}), ("logprobs", {"logprobs": 1.5}),
    ("prompt_logprobs", {"prompt_logprobs": -5}),
    ("logit_bias", {"logit_bias": [1, 2]}), ("logit_bias", {"logit_bias": {"a": 1.0}}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}), ("logit_bias", {"logit_bias": {1: float("nan")}}),
    ("allowed_token_ids", {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [-1]}),
    ("allowed_token_ids", {"allowed_token_ids": "12"}),
    ("bad_words", {"bad_words": [""]}), ("bad_words", {"bad_words": "word"}),
    ("bad_words_token_ids", {"bad_words_token_ids": [[]]}),
    ("bad_words_token_ids", {"bad_words_token_ids": [[-3]]}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": -2}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": 1}),
    ("skip_special_tokens", {"skip_special_tokens": "no"}),
])
def test_new_invalid_values_raise_naming_field(field, kwargs):
    with pytest.raises(ValueError) as ei:
        SamplingParams(**kwargs)
    assert field in str(ei.value)
