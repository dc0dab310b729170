"""WholeCallsToolParser: the base of the parsers that read each call once it is written whole.

A format is where its calls start in the output (calls_start) and the calls complete in the text
from there (parse_calls). Whole outputs are vLLM's parsers' extract_tool_calls; streamed, the
content before the calls goes out as it comes (a partial start marker held back), and each call
goes out whole, name and arguments in one delta, once its text is complete: OpenAI clients join
the deltas the same way, where vLLM's parsers stream a call's arguments piece by piece. Used by
pythonic, llama3_json, mistral and qwen3_coder (hermes streams its arguments as vLLM's does).
"""

import json
import logging

import msgspec

from minicore.entrypoints.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
)
from minicore.entrypoints.tool_parsers.utils import partial_tag_overlap
from minicore.entrypoints.tool_records import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)

logger = logging.getLogger(__name__)

# A call's (name, arguments).
Call = tuple[str, dict]


class WholeCallsToolParser(ToolParser):
    # Where a format's calls begin; "" for a format that begins with its first call's own text.
    start_marker = ""

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._sent_content_idx = 0

    def calls_start(self, text: str) -> int | None:
        """The index where the calls begin in text, None where text holds none."""
        start = text.find(self.start_marker)
        return None if start == -1 else start

    def parse_calls(self, text: str, final: bool) -> list[Call]:
        """The calls complete in text (from calls_start on): with final, every call, or a
        ValueError if they do not parse as calls."""
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        start = self.calls_start(model_output)
        if start is None:
            return ExtractedToolCallInformation(False, [], model_output)
        try:
            calls = self.parse_calls(model_output[start:], final=True)
        except (ValueError, SyntaxError, TypeError, RecursionError) as e:
            logger.warning("%s: the tool calls do not parse (%s); returning the output as "
                           "content", type(self).__name__, e)
            return ExtractedToolCallInformation(False, [], model_output)
        if not calls:
            return ExtractedToolCallInformation(False, [], model_output)
        tool_calls = [ToolCall(function=FunctionCall(name, json.dumps(args, ensure_ascii=False)))
                      for name, args in calls]
        return ExtractedToolCallInformation(True, tool_calls, model_output[:start] or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> DeltaMessage | None:
        start = self.calls_start(current_text)
        end = start if start is not None else len(current_text) - partial_tag_overlap(
            current_text, self.start_marker)
        content = None
        if end > self._sent_content_idx:
            content, self._sent_content_idx = current_text[self._sent_content_idx:end], end
        deltas = []
        if start is not None:
            try:
                calls = self.parse_calls(current_text[start:], final=False)
            except (ValueError, SyntaxError, TypeError, RecursionError):
                calls = []
            for i, (name, args) in enumerate(calls[len(self.prev_tool_call_arr):],
                                             len(self.prev_tool_call_arr)):
                arguments = json.dumps(args, ensure_ascii=False)
                self.prev_tool_call_arr.append({"name": name, "arguments": args})
                self.streamed_args_for_tool.append(arguments)
                deltas.append(DeltaToolCall(index=i, id=make_tool_call_id(), type="function",
                                            function=DeltaFunctionCall(name, arguments)))
        if not (content or deltas):
            return None
        return DeltaMessage(content=content, tool_calls=deltas or msgspec.UNSET)


def json_objects(text: str) -> tuple[list, str]:
    """The JSON values at the start of text one after another (with optional separators ; or ,
    and whitespace between them), and the rest of text that is not (yet) one."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return values, text[pos:]
        values.append(value)
