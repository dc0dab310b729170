"""Structured outputs and tool calls against a running `python -m minicore serve`, with the openai
package, as one would send them to vLLM.

Start the server with a tool parser (the default model, SmolLM2-135M-Instruct, is small: the
constraints, not the model, make its answers well formed):

    .venv/bin/python -m minicore serve --enable-auto-tool-choice --tool-call-parser hermes
    .venv/bin/python examples/structured_outputs.py [--base-url http://127.0.0.1:8000/v1]

It asks for a JSON object that follows a schema (response_format), a date that matches a regex
and one of three words (vLLM's structured_outputs, through extra_body), then a call of a named
tool and a "required" tool call, and prints what came back.
"""

import argparse
import json

from openai import OpenAI

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CITY_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "country": {"type": "string", "maxLength": 20},
    "population_millions": {"type": "number", "minimum": 0, "maximum": 50}},
    "required": ["name", "country", "population_millions"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if it has one")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id

    def chat(content: str, **kwargs):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], temperature=0,
            max_tokens=128, **kwargs).choices[0]

    city = chat("Describe Paris as JSON.", response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    print("json_schema:", json.dumps(json.loads(city.message.content)))
    date = chat("When did the Berlin wall fall?",
                extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    print("regex:      ", date.message.content)
    mood = chat("Is 'I love it' positive, negative or neutral?",
                extra_body={"structured_outputs": {"choice": ["positive", "negative",
                                                              "neutral"]}})
    print("choice:     ", mood.message.content)
    for tool_choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        answer = chat("What is the weather in Rome?", tools=[WEATHER], tool_choice=tool_choice)
        for call in answer.message.tool_calls:
            print(f"tool call ({json.dumps(tool_choice)}): {call.function.name}"
                  f"({call.function.arguments}) id={call.id}, "
                  f"finish_reason={answer.finish_reason}")


if __name__ == "__main__":
    main()
