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
