"""Qwen3CoderToolParser: Qwen3-Coder's XML-like calls,
<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>.

Mirrors vllm/tool_parsers/qwen3coder_tool_parser.py: text before the first <tool_call> is
content; a value loses the newline after its opening tag and before its closing one, and is typed
by the request's tool schema as vLLM's (ParserEngine._fix_arg_types: "5" is 5 where the parameter
is an integer, a string where it is a string or has no schema). Left out: token ids.
"""

import re

from minicore.entrypoints.tool_parsers.abstract_tool_parser import ToolParserManager
from minicore.entrypoints.tool_parsers.utils import (
    coerce_to_schema_type,
    schema_types,
    tool_properties,
)
from minicore.entrypoints.tool_parsers.whole_calls import Call, WholeCallsToolParser

CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


@ToolParserManager.register_module("qwen3_coder")
class Qwen3CoderToolParser(WholeCallsToolParser):
    start_marker = "<tool_call>"

    def parse_calls(self, text: str, final: bool) -> list[Call]:
        calls = []
        for name, body in CALL.findall(text):
            schemas = tool_properties(self.tools, name.strip())
            calls.append((name.strip(), {key.strip(): _value(value, schemas.get(key.strip()))
                                         for key, value in PARAMETER.findall(body)}))
        if final and not calls:
            raise ValueError("no complete <tool_call>")
        return calls


def _value(text: str, schema):
    text = text.removeprefix("\n").removesuffix("\n")
    return coerce_to_schema_type(text, schema_types(schema)) if isinstance(schema, dict) else text
