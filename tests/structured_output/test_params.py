"""The frontend's checks of a structured-output constraint (pure Python plus xgrammar, no model):
each of vLLM's refusals names the field, the nesting bound sits exactly at 64 levels, and the
engine's config refuses what minicore does not have by name; Lark grammars, structural tags and
the whitespace bound mean what vLLM's (and xgrammar's) do."""

import json

import pytest

from minicore.config import create_engine_config
from minicore.sampling_params import StructuredOutputsParams
from minicore.structured_output.params import (
    MAX_JSON_NESTING,
    build_grammar,
    choice_grammar,
    grammar_is_likely_lark,
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
    ({"reasoning_parser": "granite"}, "'granite' is not a reasoning parser"),
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


def _accepts(params: StructuredOutputsParams, text: str, **options) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(build_grammar(params, **options), text)


# vLLM's sample_sql_statements fixture (tests/conftest.py), a Lark grammar.
SQL_LARK = """
start: select_statement

select_statement: "SELECT " column " from " table " where " condition

column: "col_1" | "col_2"

table: "table_1" | "table_2"

condition: column "=" number

number: "1" | "2"
"""


def test_lark_is_told_from_ebnf_as_vllm_tells_them_and_compiled():
    assert grammar_is_likely_lark(SQL_LARK)
    assert not grammar_is_likely_lark('// a comment with ::=\nroot ::= "a"')
    assert grammar_is_likely_lark('# root ::= "a" in a comment\nstart: "a"')
    sql = StructuredOutputsParams(grammar=SQL_LARK)
    assert _accepts(sql, "SELECT col_1 from table_2 where col_2=1")
    assert not _accepts(sql, "SELECT col_3 from table_2 where col_2=1")
    with pytest.raises(ValueError, match="invalid structured_outputs.grammar: .*unknown name"):
        build_grammar(StructuredOutputsParams(grammar="start: nothing_here"))


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_structural_tags_in_both_of_vllms_forms():
    legacy = StructuredOutputsParams(structural_tag=json.dumps({
        "type": "structural_tag", "triggers": ["<function="],
        "structures": [{"begin": "<function=get_weather>", "schema": WEATHER,
                        "end": "</function>"}]}))
    assert _accepts(legacy, 'Let me look. <function=get_weather>{"city": "Paris"}</function>')
    assert _accepts(legacy, "No call at all.")
    assert not _accepts(legacy, '<function=get_weather>{"town": "Paris"}</function>')
    current = StructuredOutputsParams(structural_tag=json.dumps({
        "type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "const_string", "value": "Answer: "},
            {"type": "json_schema", "json_schema": WEATHER}]}}))
    assert _accepts(current, 'Answer: {"city": "Rome"}')
    assert not _accepts(current, '{"city": "Rome"}')
    for spec, message in [("not json", "not JSON"), ('{"structures": [{}], "triggers": []}',
                                                     "needs begin, schema and end"),
                          ('{"type": "structural_tag", "format": {}}', "Invalid format")]:
        with pytest.raises(ValueError, match=message):
            validate_structured_outputs(StructuredOutputsParams(structural_tag=spec))


def test_json_whitespace_is_bounded_where_asked():
    obj = StructuredOutputsParams(json_object=True)
    runaway = '{"a":' + "\n" * 40 + "1}"
    assert _accepts(obj, runaway)  # vLLM's grammar: any run of whitespace
    assert not _accepts(obj, runaway, max_whitespace_cnt=16)
    assert _accepts(obj, '{\n    "a": {\n        "b": 1\n    }\n}', max_whitespace_cnt=16)
    assert not _accepts(obj, '{"a": 1}', disable_any_whitespace=True, max_whitespace_cnt=16)
    assert _accepts(obj, '{"a":1}', disable_any_whitespace=True)
