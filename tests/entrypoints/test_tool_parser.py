"""Chat tools without a server: the hermes parser on model outputs (several calls, text before
them, an unclosed or malformed call), streamed at every split point against the whole parse; the
"required" array streamed the same way; the schemas named and "required" tool choice constrain the
output to (compiled by xgrammar, checked with jsonschema); tool and tool_choice checks with vLLM's
messages; outputs read into messages and finish reasons; tools reaching the chat template; and
tool choices a server without a parser refuses before any engine request."""

import json
from types import SimpleNamespace

import jsonschema
import pytest

from minicore.config import create_engine_config
from minicore.entrypoints.chat_utils import apply_hf_chat_template, parse_chat_messages
from minicore.entrypoints.openai_protocol import ChatCompletionRequest, OpenAIError
from minicore.entrypoints.serving import OpenAIServing
from minicore.entrypoints.tool_calls import check_tools
from minicore.entrypoints.tool_parsers import ToolParserManager
from minicore.entrypoints.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from minicore.model.loader import load_tokenizer, resolve_model_dir
from minicore.sampling_params import StructuredOutputsParams
from minicore.structured_output.params import build_grammar

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
MESSAGES = [{"role": "user", "content": "hi"}]

# Outputs in the hermes format as models write them (Hermes-2-Pro, Qwen2.5): text, then calls.
TWO_CALLS = ('Let me look {that} up.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "note": "a \\"}\\" </tool_call-ish>"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
UNCLOSED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}'


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def hermes() -> type:
    return ToolParserManager.get_tool_parser("hermes")


def assemble(deltas) -> tuple[str, list[dict]]:
    """The content and the calls a client puts together from stream deltas (None skipped);
    asserts the first delta of each call carries its id, type and name and later ones do not."""
    content, calls = "", {}
    for delta in filter(None, deltas):
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.function.name is None
            calls[call.index]["arguments"] += call.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)]


def stream_hermes(text: str, size: int) -> tuple[str, list[dict]]:
    parser, previous, deltas = hermes()(), "", []
    for i in range(0, len(text), size):
        piece = text[i:i + size]
        deltas.append(parser.extract_tool_calls_streaming(previous, previous + piece, piece))
        previous += piece
    return assemble(deltas)


def test_hermes_reads_calls_and_the_text_before_them():
    info = Hermes2ProToolParser().extract_tool_calls(TWO_CALLS)
    assert info.tools_called and info.content == "Let me look {that} up.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_weather", {"city": "Paris", "note": 'a "}" </tool_call-ish>'}), ("now", {})]
    assert len({c.id for c in info.tool_calls}) == 2
    info = Hermes2ProToolParser().extract_tool_calls(UNCLOSED)  # cut off before its end tag
    assert info.content is None and json.loads(info.tool_calls[0].function.arguments) == {
        "city": "Rome", "days": 3}


@pytest.mark.parametrize("output", [
    "no calls here", "<tool_call>\n{\"name\": \"now\", \"arguments\": {}\n</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": 3, "arguments": {}}',
    "<tool_call>[1]</tool_call>"])
def test_hermes_leaves_text_without_a_readable_call_as_content(output):
    info = Hermes2ProToolParser().extract_tool_calls(output)
    assert (info.tools_called, info.tool_calls, info.content) == (False, [], output)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 1000])
@pytest.mark.parametrize("output", [TWO_CALLS, UNCLOSED])
def test_hermes_streamed_at_any_split_assembles_to_the_whole_parse(output, size):
    whole = Hermes2ProToolParser().extract_tool_calls(output)
    content, calls = stream_hermes(output, size)
    assert content == (whole.content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]


def test_hermes_streaming_holds_back_a_partial_tag_and_sends_plain_text():
    parser = Hermes2ProToolParser()
    assert parser.extract_tool_calls_streaming("", "Hi <tool_", "Hi <tool_").content == "Hi "
    assert parser.extract_tool_calls_streaming("Hi <tool_", "Hi <tool_x", "x").content == "<tool_x"
    assert stream_hermes("plain <b>text</b> <tool", 2) == ("plain <b>text</b> ", [])


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Paris", "s": "]}\\"{,:"}}, '
            '{"name": "now", "parameters": {}}]')


@pytest.mark.parametrize("size", [1, 2, 4, 9, 1000])
def test_a_required_array_streamed_at_any_split_goes_out_whole_at_the_end(size):
    parser = check_tools(request(tools=TOOLS, tool_choice="required"), hermes()).parser()
    pieces = [REQUIRED[start:start + size] for start in range(0, len(REQUIRED), size)]
    deltas = [parser.parse_delta(p, None) for p in pieces[:-1]]
    assert deltas == [None] * len(deltas)  # nothing before the output ends
    content, calls = assemble([parser.parse_delta(pieces[-1], "stop")])
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "s": ']}"{,:'}), ("now", {})]
    assert parser.stream_finish_reason("stop") == "tool_calls"


def test_named_and_required_schemas_as_vllm_builds_them():
    tools = check_tools(request(tools=TOOLS, tool_choice=named("get_weather")), hermes())
    assert tools.json_schema() == WEATHER
    assert check_tools(request(tools=TOOLS, tool_choice=named("now")), hermes()).json_schema() == {
        "type": "object", "properties": {}}
    schema = check_tools(request(tools=TOOLS, tool_choice="required",
                                 parallel_tool_calls=False), hermes()).json_schema()
    assert schema == {"type": "array", "minItems": 1, "maxItems": 1, "items": {
        "type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["now"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]}]}}
    build_grammar(StructuredOutputsParams(json=schema))  # xgrammar compiles it
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}}], schema)
    for wrong in ([], [{"name": "get_weather", "parameters": {"city": "Oslo"}}],
                  [{"name": "now", "parameters": {}}] * 2, [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert check_tools(request(tools=TOOLS, tool_choice="auto"), hermes()).json_schema() is None


def test_required_schema_hoists_defs_and_refuses_two_schemas_of_one_name():
    item = {"type": "object", "properties": {"n": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": f, "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/item"}}, "$defs": {"item": d}}}}
        for f, d in (("a", item), ("b", item))]
    schema = check_tools(request(tools=tools, tool_choice="required"), hermes()).json_schema()
    assert schema["$defs"] == {"item": item}
    assert all("$defs" not in i["properties"]["parameters"] for i in schema["items"]["anyOf"])
    assert "$defs" in tools[0]["function"]["parameters"]  # the request's tools are not changed
    jsonschema.validate([{"name": "b", "parameters": {"x": {"n": 1}}}], schema)
    tools[1]["function"]["parameters"]["$defs"]["item"] = {"type": "string"}
    with pytest.raises(OpenAIError, match="has multiple schemas") as e:
        check_tools(request(tools=tools, tool_choice="required"), hermes()).json_schema()
    assert e.value.param == "tools"


@pytest.mark.parametrize("fields, param, message", [
    ({"tools": []}, "tools", "`tools` must not be an empty array"),
    ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice",
     'Invalid value for `tool_choice`: sometimes! Only named tools, "none", "auto" or "required"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function",
     "Invalid value for `function`: `None` in `tool_choice`!"),
    ({"tools": TOOLS, "tool_choice": {"function": {}}}, "tool_choice.function.name",
     "Expected field `name` in `function` in `tool_choice`!"),
    ({"tools": TOOLS, "tool_choice": named("")}, "tool_choice.function.name", "Invalid `name`"),
    ({"tools": TOOLS, "tool_choice": named("other")}, "tool_choice",
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools", "tools[0] must be"),
    ({"tools": [{"function": {"name": "f", "parameters": "x"}}]}, "tools",
     "tools[0].function.parameters must be dict or NoneType"),
    ({"tools": [{"function": {"name": "f", "examples": []}}]}, "tools", "unknown field"),
    ({"tools": TOOLS, "tool_choice": named("now"), "structured_outputs": {"regex": "a"}},
     "structured_outputs", "You can only either use constraints for structured outputs or tools"),
])
def test_tool_checks_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(OpenAIError) as e:
        check_tools(request(**fields), hermes())
    assert (e.value.status, e.value.param) == (400, param) and message in e.value.message


@pytest.mark.parametrize("fields, message", [
    ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice and '
                       "--tool-call-parser to be set"),
    ({"tools": TOOLS, "tool_choice": "required"},
     'tool_choice="required" requires --tool-call-parser to be set'),
    ({"tools": TOOLS, "tool_choice": named("now")},
     'tool_choice=function "now" requires --tool-call-parser to be set'),
])
def test_without_a_parser_only_tool_choice_none_is_served(fields, message):
    with pytest.raises(OpenAIError) as e:
        check_tools(request(**fields), None)
    assert (e.value.param, e.value.message) == ("tool_choice", message)
    # "none", given or implied (explicit null, no tools) is plain text.
    for fields in ({"tools": TOOLS, "tool_choice": "none"}, {"tools": TOOLS, "tool_choice": None},
                   {}):
        assert check_tools(request(**fields), None).tool_choice == "none"
    assert check_tools(request(tools=TOOLS, tool_choice=None), hermes()).tool_choice == "auto"


def parse(text, finish="stop", **fields):
    """(content, [(name, arguments)], finish reason) of a whole output."""
    tools = check_tools(request(tools=TOOLS, **fields), hermes())
    message, reason = tools.parser().parse(text, finish)
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    return message.content, calls, reason


def test_outputs_read_into_messages_with_vllms_finish_reasons():
    assert parse('{"city": "Rome"}', tool_choice=named("get_weather")) == (
        "", [("get_weather", '{"city": "Rome"}')], "stop")
    assert parse("  ", "length", tool_choice=named("now")) == ("", [], "length")
    two = ('[{"name": "now", "parameters": {}}, '
           '{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert parse(two, tool_choice="required") == (
        "", [("now", "{}"), ("get_weather", '{"city": "Rome"}')], "tool_calls")
    assert parse(two, tool_choice="required", parallel_tool_calls=False)[1] == [("now", "{}")]
    assert parse('[{"name": "now", "para', "length", tool_choice="required") == ("", [], "length")
    assert parse(TWO_CALLS, "length")[2] == "tool_calls"  # auto: any call found
    assert parse("just text", tool_choice="auto") == ("just text", [], "stop")
    assert parse(TWO_CALLS, tool_choice="none") == (TWO_CALLS, [], "stop")


def test_streamed_finish_reason_and_named_deltas():
    tools = check_tools(request(tools=TOOLS, tool_choice=named("get_weather")), hermes())
    parser = tools.parser()
    content, calls = assemble([parser.parse_delta(p, f) for p, f in (
        ('{"ci', None), ("", None), ('ty": "Rome"}', "stop"))])
    assert (content, calls[0]["name"], calls[0]["arguments"]) == (
        "", "get_weather", '{"city": "Rome"}')
    assert parser.stream_finish_reason("stop") == "stop"  # named: stop, as vLLM
    required = check_tools(request(tools=TOOLS, tool_choice="required"), hermes()).parser()
    required.parse_delta('[{"name": "now", "parameters": {}}]', "stop")
    assert required.stream_finish_reason("stop") == "tool_calls"
    assert required.stream_finish_reason("length") == "length"
    auto = check_tools(request(tools=TOOLS), hermes()).parser()
    assert auto.parse_delta("no call", None) is not None
    assert auto.stream_finish_reason("stop") == "stop"


def test_a_named_or_required_call_cut_by_max_tokens_is_no_call_streamed_or_not():
    """vLLM's test_max_tokens_with_tool_choice_required, for both constrained choices."""
    for choice, cut in ((named("get_weather"), '{"city": "Ro'), ("required", '[{"name": "no')):
        tools = check_tools(request(tools=TOOLS, tool_choice=choice), hermes())
        assert parse(cut, "length", tool_choice=choice) == ("", [], "length")
        parser = tools.parser()
        assert [parser.parse_delta(cut[:3], None), parser.parse_delta(cut[3:], "length")] == [
            None, None]
        assert parser.stream_finish_reason("length") == "length"
    # Cut exactly where the arguments end: they are whole, so the call stands.
    assert parse('{"city": "Rome"}', "length", tool_choice=named("get_weather"))[1] == [
        ("get_weather", '{"city": "Rome"}')]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir(None), vocab_size=False)


TOOLS_TEMPLATE = ("{% for t in tools or [] %}[{{ t.function.name }}:{{ t.function.description }}"
                  ":{{ t.function.parameters.required }}]{% endfor %}{{ messages[0].content }}")


def test_tools_reach_the_template_and_request_kwargs_win(tokenizer):
    tools = check_tools(request(tools=TOOLS, tool_choice="none"), None).tools
    conversation = parse_chat_messages(MESSAGES)
    render = dict(chat_template=TOOLS_TEMPLATE, add_generation_prompt=True)
    assert apply_hf_chat_template(tokenizer, conversation, tools=tools, **render) == (
        "[get_weather:Weather:['city']][now:None:]hi")
    assert apply_hf_chat_template(tokenizer, conversation, tools=tools, **render,
                                  chat_template_kwargs={"tools": tools[1:]}) == "[now:None:]hi"
    client = SimpleNamespace(tokenizer=tokenizer, vocab_size=10, config=create_engine_config())
    serving = OpenAIServing(client, ["m"], trust_request_chat_template=True)
    assert serving.render_chat(request(chat_template=TOOLS_TEMPLATE), tools)[1] == (
        "[get_weather:Weather:['city']][now:None:]hi")


async def test_a_server_without_a_parser_refuses_before_any_engine_request(tokenizer):
    def generate(*args, **kwargs):
        raise AssertionError("an engine request was made")

    client = SimpleNamespace(tokenizer=tokenizer, vocab_size=10, config=create_engine_config(),
                             errored=False, generate=generate)
    # --tool-call-parser without --enable-auto-tool-choice serves no parser either, as vLLM.
    for serving in (OpenAIServing(client, ["m"]), OpenAIServing(client, ["m"],
                                                                tool_parser="hermes")):
        with pytest.raises(OpenAIError) as e:
            await serving.create_chat_completion(request(tools=TOOLS, max_tokens=4))
        assert (e.value.status, e.value.param) == (400, "tool_choice")
        assert e.value.message.startswith('"auto" tool choice requires')
