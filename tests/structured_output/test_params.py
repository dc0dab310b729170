"""The frontend's checks of a structured-output constraint (pure Python plus xgrammar, no model):
each of vLLM's refusals names the field, the nesting bound sits exactly at 64 levels, and the
engine's config refuses what minicore does not have by name."""

import pytest

from minicore.config import create_engine_config
from minicore.sampling_params import StructuredOutputsParams
from minicore.structured_output.params import (
    MAX_JSON_NESTING,
    choice_grammar,
    validate_structured_outputs,
)


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("constraint, message", [
    ({"json": "  "}, "structured_outputs.json cannot be an empty string"),
    ({"grammar": ""}, "structured_outputs.grammar cannot be an empty string"),
    ({"json_object": False}, "structured_outputs.json_object must be true"),
    ({"regex": "a\x00b"}, "must not contain a NUL character"),
    ({"json": nested(MAX_JSON_NESTING + 1)}, "nested too deeply"),
    ({"json": "[" * 100_000}, "nested too deeply"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}},
     "invalid structured_outputs.json"),
    ({"regex": "[z-a]"}, "invalid structured_outputs.regex"),
    ({"grammar": "root ::= other"}, "invalid structured_outputs.grammar"),
])
def test_bad_constraints_are_refused_naming_the_field(constraint, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        validate_structured_outputs(StructuredOutputsParams(**constraint))


def test_the_nesting_bound_is_inclusive_and_good_constraints_pass():
    validate_structured_outputs(StructuredOutputsParams(json=nested(MAX_JSON_NESTING)))
    for constraint in ({"json_object": True}, {"regex": r"\d+"}, {"choice": ['say "hi"', "a\\b"]},
                       {"grammar": 'root ::= "x"'}, {"json": '{"type": "integer"}'}):
        validate_structured_outputs(StructuredOutputsParams(**constraint))


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="non-empty list of non-empty strings"):
        StructuredOutputsParams(choice=["a", ""])


def test_choices_are_quoted_into_an_alternation():
    assert choice_grammar(['say "hi"', "a\\b"]) == 'root ::= "say \\"hi\\"" | "a\\\\b"'


@pytest.mark.parametrize("config, message", [
    ({"backend": "guidance"}, "backend 'guidance' is not available in minicore"),
    ({"backend": "nope"}, "backend 'nope' is unknown"),
    ({"disable_additional_properties": True}, "only supported by vLLM's guidance backend"),
    ({"reasoning_parser": "deepseek_r1"}, "reasoning parsers are not supported"),
    ({"disable_any_whitespace": "yes"}, "must be true or false"),
    ('{"backnd": "auto"}', "unknown key"),
])
def test_the_structured_outputs_config_refuses_what_minicore_lacks(config, message):
    with pytest.raises(ValueError, match=message):
        create_engine_config(structured_outputs_config=config)


def test_the_structured_outputs_config_reads_json_and_dicts():
    config = create_engine_config(
        structured_outputs_config='{"backend": "xgrammar", "disable_any_whitespace": true}')
    assert config.structured_outputs_config.disable_any_whitespace
    assert create_engine_config().structured_outputs_config.backend == "auto"
