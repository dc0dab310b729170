"""--speculative-config and LLM(speculative_config=) without a model: the flag parses vLLM's JSON
into a SpeculativeConfig with vLLM's defaults, reaches EngineConfig, is in serve's and generate's
--help, and every bad value is one argparse error naming the flag; the LLM keyword takes a dict
or a SpeculativeConfig, and refuses what the flag refuses, and the simulated runner, before any
model is loaded."""

import json

import pytest

from minicore.__main__ import make_parser
from minicore.config import create_engine_config
from minicore.engine.arg_utils import engine_kwargs_from_cli
from minicore.llm import LLM
from minicore.spec_decode.config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2}


def parse(*argv):
    return make_parser().parse_args(["serve", *argv])


def test_the_flag_reaches_the_engine_config():
    args = parse("--speculative-config", json.dumps(NGRAM))
    expected = SpeculativeConfig(**NGRAM)
    assert args.speculative_config == expected
    config = create_engine_config(**engine_kwargs_from_cli(args))
    assert config.speculative_config == expected


def test_without_the_flag_there_is_no_speculative_config():
    args = parse()
    assert args.speculative_config is None
    assert create_engine_config(**engine_kwargs_from_cli(args)).speculative_config is None


@pytest.mark.parametrize("given, lookup", [
    ({}, (5, 5)), ({"prompt_lookup_max": 4}, (4, 4)), ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 6}, (1, 6))])
def test_vllm_defaults_for_the_lookup_lengths(given, lookup):
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 2, **given})
    config = parse("--speculative-config", text).speculative_config
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == lookup
    assert config.disable_by_batch_size is None


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_shows_the_flag_in_its_group(command, capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    section = out.split("speculative decoding:\n", 1)[1]
    assert section.lstrip().startswith("--speculative-config JSON")
    assert '"method": "ngram"' in " ".join(section.split())


@pytest.mark.parametrize("text, message", [
    ('{"method": "eagle", "num_speculative_tokens": 3}',
     "method 'eagle' is not supported by minicore: methods 'mtp', 'ngram'"),
    ('{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}',
     "a draft model ('tiny') is not supported"),
    ('{"num_speculative_tokens": 3}', "method None is not supported"),
    ('{"method": "ngram"}', "num_speculative_tokens must be an integer >= 1, got None"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 3}', "prompt_lookup_min (4) must be <= prompt_lookup_max (3)"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}',
     "prompt_lookup_min must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 1}',
     "disable_by_batch_size must be an integer >= 2"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "k": 2}', "unknown key(s) k"),
    ("ngram", "not JSON"),
    ("[1]", "expected a JSON object"),
])
def test_a_bad_value_is_one_error_naming_the_flag(text, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--speculative-config", text)
    assert exit_info.value.code == 2
    *_, last = capsys.readouterr().err.strip().splitlines()
    assert last.startswith("python -m minicore serve: error: argument --speculative-config: ")
    assert message in last


def test_the_simulated_runner_is_refused():
    args = parse("--runner", "simulated", "--speculative-config", json.dumps(NGRAM))
    with pytest.raises(ValueError, match="no model to verify drafts against"):
        create_engine_config(**engine_kwargs_from_cli(args))


@pytest.mark.parametrize("value", [NGRAM, SpeculativeConfig(**NGRAM), json.dumps(NGRAM)])
def test_the_llm_keyword_takes_a_dict_or_a_config(value):
    # create_engine_config is what LLM(**engine_args) builds its config with.
    assert create_engine_config(speculative_config=value).speculative_config == \
        SpeculativeConfig(**NGRAM)


@pytest.mark.parametrize("kwargs, message", [
    ({"speculative_config": {"method": "medusa", "num_speculative_tokens": 2}},
     "method 'medusa' is not supported"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "n": 3}},
     "unknown key"),
    ({"speculative_config": NGRAM, "runner": "simulated"}, "no model to verify drafts against"),
])
def test_llm_refuses_before_loading_a_model(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(**kwargs)
