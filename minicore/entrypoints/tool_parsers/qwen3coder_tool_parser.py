"""Qwen3CoderToolParser: Qwen3-Coder's XML-like calls,
<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>.

Mirrors vllm/tool_parsers/qwen3coder_tool_parser.py: text before the first <tool_call> is
content; a value loses the newline after its opening tag and before its closing one. vLLM types
each value by the tool's schema; here a value that is JSON other than a string (a number, a
boolean, null, an object, a list) becomes that, and anything else stays a string (minicore's
parsers are not given the request's tools). Left out: token ids.
"""

import json
import re

from minicore.entrypoints.tool_parsers.abstract_tool_parser import ToolParserManager
from minicore.entrypoints.tool_parsers.whole_calls import Call, WholeCallsToolParser

CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


@ToolParserManager.register_module("qwen3_coder")
class Qwen3CoderToolParser(WholeCallsToolParser):
    start_marker = "<tool_call>"

    def parse_calls(self, text: str, final: bool) -> list[Call]:
        calls = [(name.strip(), {key.strip(): _value(value)
                                 for key, value in PARAMETER.findall(body)})
                 for name, body in CALL.findall(text)]
        if final and not calls:
            raise ValueError("no complete <tool_call>")
        return calls


def _value(text: str):
    text = text.removeprefix("\n").removesuffix("\n")
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) else value
