"""The tool call parsers beside hermes, on model outputs in each format as vLLM's parser tests
hold them: llama3_json (Llama 3.1/3.2), pythonic (Llama 3.2/4), mistral (both of its formats)
and qwen3_coder. Whole, each output gives its calls and content; streamed in pieces of every size
from 1 to 7 characters, the deltas joined give the same calls and content; an output that is not
calls stays content."""

import json

import pytest

from minicore.entrypoints.tool_parsers import ToolParserManager

WEATHER = ("get_weather", {"city": "San Francisco", "metric": "celsius"})
TIME = ("get_time", {})
# (parser, model output, expected calls, expected content)
CASES = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "San Francisco", '
                    '"metric": "celsius"}}', [WEATHER], None),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": '
                    '"San Francisco", "metric": "celsius"}}; {"name": "get_time", '
                    '"arguments": {}}', [WEATHER, TIME], None),
    ("llama3_json", "The weather in Paris is sunny.", [], "The weather in Paris is sunny."),
    ("pythonic", '[get_weather(city="San Francisco", metric="celsius"), get_time()]',
     [WEATHER, TIME], None),
    ("pythonic", "<|python_start|>[get_weather(city='San Francisco', metric='celsius')]"
                 "<|python_end|>", [WEATHER], None),
    ("pythonic", "[register(name='Ann', tags=['a', 'b'], age=31, active=True, extra=None)]",
     [("register", {"name": "Ann", "tags": ["a", "b"], "age": 31, "active": True,
                    "extra": None})], None),
    ("pythonic", "I cannot call a tool for that.", [], "I cannot call a tool for that."),
    ("mistral", 'Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
                '"San Francisco", "metric": "celsius"}}, {"name": "get_time", "arguments": {}}]',
     [WEATHER, TIME], "Let me look. "),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "San Francisco", "metric": "celsius"}'
                '[TOOL_CALLS]get_time{}', [WEATHER, TIME], None),
    ("mistral", "No tool needed.", [], "No tool needed."),
    ("qwen3_coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                    "San Francisco\n</parameter>\n<parameter=metric>\ncelsius\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n"
                    "</tool_call>", [WEATHER, TIME], "I will check.\n"),
    # No tool schema: every value stays text, as vLLM's (typed by the schema: below).
    ("qwen3_coder", "<tool_call>\n<function=book>\n<parameter=seats>\n4\n</parameter>\n"
                    "<parameter=options>\n{\"window\": true}\n</parameter>\n</function>\n"
                    "</tool_call>", [("book", {"seats": "4", "options": '{"window": true}'})],
     None),
]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


@pytest.mark.parametrize("name, output, calls, content", CASES, ids=IDS)
def test_a_whole_output(name, output, calls, content):
    info = ToolParserManager.get_tool_parser(name)().extract_tool_calls(output)
    assert info.tools_called == bool(calls)
    assert calls_of(info.tool_calls) == calls
    assert info.content == (content if calls else output)


@pytest.mark.parametrize("name, output, calls, content", CASES, ids=IDS)
@pytest.mark.parametrize("piece", range(1, 8))
def test_streamed_in_pieces(name, output, calls, content, piece):
    parser = ToolParserManager.get_tool_parser(name)()
    sent_content, sent_calls, previous = "", {}, ""
    for start in range(0, len(output), piece):
        current = output[:start + piece]
        delta = parser.extract_tool_calls_streaming(previous, current, current[len(previous):])
        previous = current
        if delta is None:
            continue
        sent_content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = sent_calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in sent_calls.values()] == calls
    assert sent_content == (content or "" if calls else output)


@pytest.mark.parametrize("name, output", [
    ("pythonic", "[get_weather('San Francisco')]"),  # positional: not a call vLLM takes
    ("pythonic", "[get_weather(city=open('x'))]"),  # not a literal: nothing is evaluated
    ("llama3_json", '{"name": "get_weather", "parameters": "Paris"}'),
    ("mistral", "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}"),  # cut short
])
def test_calls_that_do_not_parse_are_content(name, output):
    info = ToolParserManager.get_tool_parser(name)().extract_tool_calls(output)
    assert not info.tools_called and info.content == output


BOOK = [{"type": "function", "function": {"name": "book", "parameters": {"type": "object",
         "properties": {
             "seats": {"type": "integer"}, "price": {"type": "number"},
             "window": {"type": "boolean"}, "note": {"type": ["string", "null"]},
             "zip": {"type": "string"}, "options": {"type": "object"},
             "tags": {"type": "array"}, "size": {"enum": [1, 2, 3]},
             "when": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
             "count": {"type": "int"}, "ratio": {"type": "number"}, "flag": {"type": "boolean"},
             "untyped": {"description": "no type"}}}}}]


def test_qwen3_coder_types_each_value_by_the_tools_schema():
    values = {"seats": "4", "price": "9.50", "window": "true", "note": "null", "zip": "02139",
              "options": '{"aisle": false}', "tags": '["a", 1]', "size": "2", "when": "7",
              "count": "12", "ratio": "3.0", "flag": "maybe", "untyped": "[1]", "extra": "5"}
    output = "<tool_call>\n<function=book>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items()
    ) + "</function>\n</tool_call>"
    info = ToolParserManager.get_tool_parser("qwen3_coder")(BOOK).extract_tool_calls(output)
    assert calls_of(info.tool_calls) == [("book", {
        "seats": 4, "price": 9.5, "window": True, "note": None, "zip": "02139",
        "options": {"aisle": False}, "tags": ["a", 1], "size": 2, "when": 7,
        "count": 12,  # a type name models write: vLLM's aliases
        "ratio": 3,  # a whole number, as vLLM writes it
        "flag": "maybe",  # not a boolean: kept as written
        "untyped": "[1]", "extra": "5"})]  # no type, no schema: text
