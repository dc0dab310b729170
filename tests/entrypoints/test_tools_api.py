"""Chat tool calls end to end: the openai SDK against one real `serve --enable-auto-tool-choice
--tool-call-parser hermes` on the default model. "required" and named tool choice return calls
whose arguments validate against the tool's parameters, with vLLM's finish reasons ("tool_calls",
"stop"); streamed, the deltas assemble to the same calls; "auto" reads hermes <tool_call>s (the
output forced by a regex, as a 135M model does not write them by itself); bad tools are 400s
naming the field. A server without the flags is in test_tool_parser.py."""

import json
import re
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_helpers import check_openai_error, run_python

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
# Bounded parameters, so that the constrained model finishes its JSON in a few tokens.
PARAMETERS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False},
    "add": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": params}}
         for name, params in PARAMETERS.items()]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ADD = {"type": "function", "function": {"name": "add"}}
CASES = {"required": ("required", "tool_calls"), "named": (ADD, "stop")}
# "auto": the hermes format, forced.
FORCED = r'Ok <tool_call>\{"name": "add", "arguments": \{"a": 1, "b": 2\}\}</tool_call>'


@pytest.fixture(scope="module")
def server(structured_server):
    return structured_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def create(client, tool_choice, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                          tool_choice=tool_choice, temperature=0, max_tokens=80,
                                          parallel_tool_calls=False, **kwargs)


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, the arguments checked against the tool's parameters."""
    result = []
    for call in tool_calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        result.append((call.function.name, arguments))
    return result


def stream(client, tool_choice, **kwargs) -> tuple[str | None, list, str]:
    """The content, the calls and the finish reason a client assembles from a stream."""
    chunks = list(create(client, tool_choice, stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    content, calls, finish = None, {}, None
    for chunk in chunks:
        (choice,) = chunk.choices
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:  # the first delta: id, type and name
                assert delta.id.startswith("chatcmpl-tool-") and delta.type == "function"
                calls[delta.index] = delta.model_copy(deep=True)
                calls[delta.index].function.arguments = delta.function.arguments or ""
            else:
                assert delta.id is None and delta.function.name is None
                calls[delta.index].function.arguments += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls_of(calls[i] for i in sorted(calls)), finish


@pytest.fixture(scope="module")
def whole(client):
    """The whole response of each tool choice."""
    return {case: create(client, choice) for case, (choice, _) in CASES.items()}


@pytest.mark.parametrize("case", CASES)
def test_required_and_named_return_calls_that_fit_the_tool(whole, case):
    (choice,) = whole[case].choices
    calls = calls_of(choice.message.tool_calls)
    assert choice.finish_reason == CASES[case][1] and choice.message.content == ""
    assert len(calls) == 1 and choice.message.tool_calls[0].id.startswith("chatcmpl-tool-")
    if case == "named":
        assert calls[0][0] == "add"


@pytest.mark.parametrize("case", CASES)
def test_streamed_calls_assemble_to_the_whole_response(client, whole, case):
    (choice,) = whole[case].choices
    content, calls, finish = stream(client, CASES[case][0])
    assert (content, calls, finish) == (None, calls_of(choice.message.tool_calls),
                                        choice.finish_reason)


def test_auto_reads_hermes_tool_calls_whole_and_streamed(client):
    forced = {"structured_outputs": {"regex": FORCED}}
    (choice,) = create(client, "auto", extra_body=forced).choices
    expected = [("add", {"a": 1, "b": 2})]
    assert (choice.message.content, calls_of(choice.message.tool_calls), choice.finish_reason) == (
        "Ok ", expected, "tool_calls")
    assert stream(client, "auto", extra_body=forced) == ("Ok ", expected, "tool_calls")


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_are_400s_naming_the_field(server, fields, param):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": MESSAGES, "max_tokens": 4, **fields})
    assert check_openai_error(response, 400)["param"] == param


def test_the_structured_outputs_example_runs_against_the_server(server):
    example = Path(__file__).resolve().parents[2] / "examples" / "structured_outputs.py"
    result = run_python([sys.executable, example, "--base-url", server.url + "/v1"], timeout=300)
    assert result.returncode == 0, result.stderr
    head = (line.split(":", 1) for line in result.stdout.splitlines()[:3])
    lines = {name.strip(): value for name, value in head}
    assert set(json.loads(lines["json_schema"])) == {"name", "country", "population_millions"}
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", lines["regex"].strip())
    assert lines["choice"].strip() in ("positive", "negative", "neutral")
    assert result.stdout.count("tool call (") == 2 and "get_weather(" in result.stdout
