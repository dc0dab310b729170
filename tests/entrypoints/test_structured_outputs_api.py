"""Structured outputs through the OpenAI API: response_format and structured_outputs become the
StructuredOutputsParams vLLM 0.32 would make (unit tests, no server), and a real `serve` process
on the default model obeys them: JSON schemas validate, regexes match, choices and grammars hold,
whole, streamed, with n=2, through httpx and the openai SDK; a bad constraint is a 400 naming the
field the client used, sent to no engine, and the server keeps serving."""

import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_helpers import check_openai_error

from minicore.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
)
from minicore.entrypoints.response_format import REMOVED_GUIDED_FIELDS
from minicore.sampling_params import StructuredOutputsParams
from minicore.structured_output.params import MAX_JSON_NESTING

MODEL = "SmolLM2-135M-Instruct"
# Bounded values, so that the small model's output ends well within max_tokens.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "count"],
          "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 9}}}
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
QUESTION = [{"role": "user", "content": "Is Paris in France? Answer in JSON."}]
OK_OBJECT = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} only.'}]
PHONE = r"\d{3}-\d{4}"
GRAMMAR = 'root ::= "one" (", " number){2}\nnumber ::= "two" | "three"'


def nested(depth: int) -> dict:
    """A schema (arrays of arrays) whose JSON nests depth objects."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


# ------------------------------------------------------------------ conversion (no server)


def params_of(**fields) -> tuple[StructuredOutputsParams | None, str]:
    request = CompletionRequest(prompt="x", **fields)
    request.check_unsupported()
    return request.to_sampling_params(8).structured_outputs, request.field_of("structured_outputs")


@pytest.mark.parametrize("fields, expected, field", [
    ({}, None, "structured_outputs"),
    ({"response_format": {"type": "text"}}, None, "structured_outputs"),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True),
     "response_format"),
    ({"response_format": JSON_SCHEMA_FORMAT}, StructuredOutputsParams(json=SCHEMA),
     "response_format"),
    ({"structured_outputs": {"regex": PHONE}}, StructuredOutputsParams(regex=PHONE),
     "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=["a", "b"]),
     "structured_outputs"),
    ({"structured_outputs": {"grammar": GRAMMAR}}, StructuredOutputsParams(grammar=GRAMMAR),
     "structured_outputs"),
    ({"structured_outputs": {"json": '{"type": "object"}', "disable_any_whitespace": True}},
     StructuredOutputsParams(json='{"type": "object"}', disable_any_whitespace=True),
     "structured_outputs"),
    # Unimplemented vLLM fields at their "not used" values pass.
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": None,
                             "disable_additional_properties": False}},
     StructuredOutputsParams(json_object=True), "structured_outputs"),
    # vLLM's replace: response_format's schema wins over structured_outputs' of the same kind,
    # whose other options stay.
    ({"response_format": JSON_SCHEMA_FORMAT,
      "structured_outputs": {"json": {"type": "string"}, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), "response_format"),
    # A structural_tag response_format is the tag, whole, as vLLM passes it on.
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<f="]}},
     StructuredOutputsParams(structural_tag=json.dumps(
         {"type": "structural_tag", "structures": [], "triggers": ["<f="]})), "response_format"),
    ({"structured_outputs": {"structural_tag": '{"type": "structural_tag"}'}},
     StructuredOutputsParams(structural_tag='{"type": "structural_tag"}'),
     "structured_outputs"),
    ({"structured_outputs": {"json": nested(MAX_JSON_NESTING)}},
     StructuredOutputsParams(json=nested(MAX_JSON_NESTING)), "structured_outputs"),
])
def test_request_fields_become_structured_outputs_params(fields, expected, field):
    assert params_of(**fields) == (expected, field)


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' field"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema must be given"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
     "response_format", "only used with type json_schema"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format", "'extra'"),
    ({"response_format": {**JSON_SCHEMA_FORMAT, "json_schema": {"name": "x", "schema": {},
                                                                "bogus": 1}}},
     "response_format", "'bogus'"),
    ({"structured_outputs": {}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "['regex', 'choice']"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"json": {}, "structural_tag": "{}"}}, "structured_outputs",
     "['json', 'structural_tag']"),
    ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern is not supported"),
    ({"structured_outputs": {"json": {}, "disable_additional_properties": True}},
     "structured_outputs", "disable_additional_properties is not supported"),
    ({"structured_outputs": {"json": {}, "disable_fallback": True}}, "structured_outputs",
     "disable_fallback is not supported"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "'jsn'"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format", "two constraints"),
    *[({name: "x"}, name, "removed in vLLM") for name in REMOVED_GUIDED_FIELDS],
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
])
def test_refused_constraints_name_the_field(fields, param, words):
    with pytest.raises(OpenAIError) as e:
        params_of(**fields)
    assert (e.value.status, e.value.param) == (400, param)
    assert words in e.value.message


def test_chat_takes_the_same_fields_and_declares_tools():
    request = ChatCompletionRequest(messages=QUESTION, response_format=JSON_SCHEMA_FORMAT,
                                    tools=[{"type": "function", "function": {"name": "f"}}],
                                    tool_choice="required")
    request.check_unsupported()  # tools are the chat endpoint's to check, not refused here
    assert request.to_sampling_params(8).structured_outputs == StructuredOutputsParams(json=SCHEMA)
    assert request.field_of("structured_outputs") == "response_format"
    assert (request.tool_choice, request.parallel_tool_calls) == ("required", True)


# ----------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(structured_server):
    return structured_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.mark.model
def test_json_schema_through_the_sdk_validates(client):
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40,
                                          temperature=0, response_format=JSON_SCHEMA_FORMAT)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    completion = client.completions.create(
        model=MODEL, prompt="Is Paris in France? JSON:", max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    text = completion.choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert not re.search(r"\s", text)


@pytest.mark.model
@pytest.mark.parametrize("constraint, check", [
    ({"regex": PHONE}, lambda text: re.fullmatch(PHONE, text)),
    ({"choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
    ({"grammar": GRAMMAR}, lambda text: re.fullmatch(r"one(, (two|three)){2}", text)),
], ids=["regex", "choice", "grammar"])
def test_regex_choice_and_grammar_are_obeyed(client, constraint, check):
    out = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20,
                                    temperature=0, extra_body={"structured_outputs": constraint})
    assert out.choices[0].finish_reason == "stop" and check(out.choices[0].text), out.choices[0]


@pytest.mark.model
def test_json_object_is_an_object(http):
    r = http.post("/v1/chat/completions", json={
        "messages": OK_OBJECT, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


@pytest.mark.model
def test_streamed_json_schema_parses_and_n2_both_validate(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40,
                                            temperature=0, stream=True,
                                            response_format=JSON_SCHEMA_FORMAT)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    two = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, n=2,
                                         temperature=1.0, seed=3,
                                         response_format=JSON_SCHEMA_FORMAT)
    assert len(two.choices) == 2
    for choice in two.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def _served(http) -> tuple[float, float]:
    """(prompt tokens run, requests finished) from /metrics."""
    values = {}
    for line in http.get("/metrics").text.splitlines():
        name = line.split("{", 1)[0]
        if name in ("vllm:prompt_tokens_total", "vllm:e2e_request_latency_seconds_count"):
            values[name] = float(line.rsplit(" ", 1)[1])
    return values["vllm:prompt_tokens_total"], values["vllm:e2e_request_latency_seconds_count"]


BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": nested(MAX_JSON_NESTING + 1)}}}, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= missing"}},
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "json_object": True}},
     "structured_outputs"),
    ("/v1/chat/completions", {"response_format": {"type": "structural_tag", "format": {}}},
     "response_format"),
    ("/v1/chat/completions", {"guided_json": SCHEMA}, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": "[" * 100_000}}, "structured_outputs"),
]


@pytest.mark.model
def test_bad_constraints_are_400_naming_the_field_and_run_nothing(http):
    before = _served(http)
    for endpoint, fields, param in BAD:
        body = {"prompt": "x"} if endpoint == "/v1/completions" else {"messages": QUESTION}
        for stream in (False, True):
            r = http.post(endpoint, json={**body, **fields, "max_tokens": 4, "n": 2,
                                          "temperature": 1.0, "stream": stream})
            assert check_openai_error(r, 400)["param"] == param, (fields, r.text)
    assert _served(http) == before
    out = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "temperature": 0,
                                             "structured_outputs": {"choice": ["a", "b"]}})
    assert out.status_code == 200 and out.json()["choices"][0]["text"] in ("a", "b")
