"""Llama3JsonToolParser: Llama 3.1 and 3.2's JSON calls, {"name": ..., "parameters": {...}} one
after another (separated by ";"), the first possibly after <|python_tag|>.

Mirrors vllm/tool_parsers/llama_tool_parser.py: an output that begins with the calls is all calls
(no content); any other output is content. "arguments" is taken for "parameters" too. Left out:
token ids.
"""

from minicore.entrypoints.tool_parsers.abstract_tool_parser import ToolParserManager
from minicore.entrypoints.tool_parsers.whole_calls import Call, WholeCallsToolParser, json_objects


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(WholeCallsToolParser):
    start_marker = "<|python_tag|>"

    def calls_start(self, text: str) -> int | None:
        body = text.lstrip()
        return 0 if body.startswith((self.start_marker, "{")) else None

    def parse_calls(self, text: str, final: bool) -> list[Call]:
        values, rest = json_objects(text.lstrip().removeprefix(self.start_marker))
        if final and rest.strip():
            raise ValueError(f"text after the calls: {rest[:40]!r}")
        calls = []
        for value in values:
            if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
                raise ValueError(f"not a call: {value!r:.60}")
            arguments = value.get("parameters", value.get("arguments", {}))
            if not isinstance(arguments, dict):
                raise ValueError(f"the arguments of {value['name']} are not an object")
            calls.append((value["name"], arguments))
        return calls
