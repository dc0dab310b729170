"""Structured outputs served as vLLM's tests send them, in each engine mode: the default, async
scheduling, ngram drafts and both each give every constrained request (JSON schema, regex, choice,
EBNF and Lark grammars, a structural tag, required and named tool calls) the same greedy answer,
valid, in float32; and a named or required tool call cut by max_tokens is no call, streamed or
not (vLLM's test_max_tokens_with_tool_choice_required)."""

import json
import re

import httpx
import jsonschema
import pytest
from server_helpers import ServerProcess

pytestmark = pytest.mark.model

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1,
                                                    "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
ASK = [{"role": "user", "content": "What will the weather be in Paris over the next days?"}]
SQL_LARK = ('start: select_statement\n'
            'select_statement: "SELECT " column " from " table " where " condition\n'
            'column: "col_1" | "col_2"\ntable: "table_1" | "table_2"\n'
            'condition: column "=" number\nnumber: "1" | "2"\n')
SQL = r"SELECT col_[12] from table_[12] where col_[12]=[12]"
STRUCTURAL_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "Forecast: "},
    {"type": "json_schema", "json_schema": SCHEMA}]}}
# (endpoint, body, check of the answer)
REQUESTS = [
    ("/v1/chat/completions", {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
     lambda a: jsonschema.validate(json.loads(a["content"]), SCHEMA)),
    ("/v1/completions", {"prompt": "Call me at", "structured_outputs": {"regex": r"\d{3}-\d{4}"}},
     lambda a: re.fullmatch(r"\d{3}-\d{4}", a["text"]) or pytest.fail(a["text"])),
    ("/v1/completions", {"prompt": "Is the sky blue? Answer:",
                         "structured_outputs": {"choice": ["yes", "no"]}},
     lambda a: a["text"] in ("yes", "no") or pytest.fail(a["text"])),
    ("/v1/completions", {"prompt": "Count:", "structured_outputs": {
        "grammar": 'root ::= "one" (", " number){2}\nnumber ::= "two" | "three"'}},
     lambda a: re.fullmatch(r"one(, (two|three)){2}", a["text"]) or pytest.fail(a["text"])),
    ("/v1/completions", {"prompt": "Write a SQL query:",
                         "structured_outputs": {"grammar": SQL_LARK}},
     lambda a: re.fullmatch(SQL, a["text"]) or pytest.fail(a["text"])),
    ("/v1/chat/completions", {"messages": ASK, "response_format": STRUCTURAL_TAG},
     lambda a: jsonschema.validate(json.loads(a["content"].removeprefix("Forecast: ")), SCHEMA)),
    ("/v1/chat/completions", {"messages": ASK, "tools": WEATHER_TOOLS,
                              "tool_choice": "required"},
     lambda a: jsonschema.validate(json.loads(a["tool_calls"][0]["function"]["arguments"]),
                                   SCHEMA)),
    ("/v1/chat/completions", {"messages": ASK, "tools": WEATHER_TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}},
     lambda a: jsonschema.validate(json.loads(a["tool_calls"][0]["function"]["arguments"]),
                                   SCHEMA)),
]


def _answers(url: str) -> list[dict]:
    answers = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for endpoint, body, check in REQUESTS:
            r = http.post(endpoint, json={**body, "max_tokens": 64, "temperature": 0})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            answer = choice.get("message") or {"text": choice["text"]}
            check(answer)
            for call in answer.get("tool_calls") or []:
                call.pop("id")  # random per call
            answers.append({**answer, "finish_reason": choice["finish_reason"]})
    return answers


@pytest.fixture(scope="module")
def default_answers(structured_server) -> list[dict]:
    return _answers(structured_server.url)


NGRAM = ("--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3}))


@pytest.mark.parametrize("mode", [("--async-scheduling",), NGRAM, ("--async-scheduling", *NGRAM)],
                         ids=["async-scheduling", "ngram-drafts", "both"])
def test_every_constraint_gives_the_default_modes_answer(mode, default_answers):
    with ServerProcess("--max-model-len", "512", "--kv-cache-memory", str(64 << 20),
                       "--max-num-seqs", "8", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", *mode) as server:
        assert _answers(server.url) == default_answers


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])
def test_a_tool_call_cut_by_max_tokens_is_no_call_streamed_or_not(structured_server,
                                                                   tool_choice):
    body = {"messages": ASK, "tools": WEATHER_TOOLS, "tool_choice": tool_choice,
            "max_completion_tokens": 1, "temperature": 0}
    with httpx.Client(base_url=structured_server.url, timeout=120) as http:
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert not choice["message"].get("tool_calls") and not choice["message"]["content"]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not any(d["delta"].get("tool_calls") for d in deltas)
    assert deltas[-1]["finish_reason"] == "length"
