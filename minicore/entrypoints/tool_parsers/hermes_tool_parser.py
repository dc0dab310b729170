"""Hermes2ProToolParser: each call written as
<tool_call>{"name": ..., "arguments": {...}}</tool_call>; text before the first call is content.

Mirrors vllm/tool_parsers/hermes_tool_parser.py. Left out: token ids (it reads text only), and the
xgrammar structural tag vLLM 0.32 builds for hermes (minicore/entrypoints/tool_calls.py says why).
"""

import dataclasses
import json
import logging
import re

import msgspec

from minicore.entrypoints.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
)
from minicore.entrypoints.tool_parsers.utils import is_complete_json, partial_tag_overlap
from minicore.entrypoints.tool_records import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)
from minicore.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    # A call's body: between the tags, or from an unclosed tag to the end of the output.
    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
    name_regex = re.compile(r'"name"\s*:\s*"([^"]+)"')
    arguments_regex = re.compile(r'"arguments"\s*:\s*')

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._sent_content_idx = 0  # streaming: the content sent so far ends here

    @classmethod
    def adjust_request(cls, params: SamplingParams) -> SamplingParams:
        # <tool_call> is a special token in some models: skipped, the calls could not be read.
        return dataclasses.replace(params, skip_special_tokens=False)

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        start = model_output.find(self.tool_call_start_token)
        if start == -1:
            return ExtractedToolCallInformation(False, [], model_output)
        try:
            calls = [json.loads(closed or unclosed)
                     for closed, unclosed in self.tool_call_regex.findall(model_output)]
            tool_calls = [ToolCall(function=FunctionCall(
                _name(call), json.dumps(call["arguments"], ensure_ascii=False)))
                for call in calls]
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            # As vLLM: a call that does not parse (or nests past Python's recursion limit)
            # leaves the whole output as content.
            logger.warning("hermes tool parser: the tool calls do not parse (%s); returning the "
                           "output as content", e)
            return ExtractedToolCallInformation(False, [], model_output)
        return ExtractedToolCallInformation(True, tool_calls, model_output[:start] or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> DeltaMessage | None:
        """vLLM's: reparse the whole text each time and send what is new: content before the
        first call (holding back what may be the start of a <tool_call> tag), each call's name
        with a new id once complete, then its argument text as it grows."""
        content = self._extract_content(current_text)
        deltas: list[DeltaToolCall] = []
        for i, (body, complete) in enumerate(self._tool_call_bodies(current_text)):
            if i == len(self.prev_tool_call_arr):
                self.prev_tool_call_arr.append({})
                self.streamed_args_for_tool.append("")
            if "name" not in self.prev_tool_call_arr[i]:
                match = self.name_regex.search(body)
                if match is None:
                    break  # calls are sent in order: the next waits for this one's name
                self.prev_tool_call_arr[i]["name"] = match.group(1)
                deltas.append(DeltaToolCall(index=i, id=make_tool_call_id(), type="function",
                                            function=DeltaFunctionCall(name=match.group(1))))
            if arguments := self._arguments_diff(i, body, complete):
                deltas.append(DeltaToolCall(index=i,
                                            function=DeltaFunctionCall(arguments=arguments)))
        if not (content or deltas):
            return None
        return DeltaMessage(content=content, tool_calls=deltas or msgspec.UNSET)

    def _extract_content(self, current_text: str) -> str | None:
        start = current_text.find(self.tool_call_start_token)
        if start == -1:
            start = len(current_text) - partial_tag_overlap(current_text,
                                                            self.tool_call_start_token)
        if start <= self._sent_content_idx:
            return None
        content = current_text[self._sent_content_idx:start]
        self._sent_content_idx = start
        return content

    def _tool_call_bodies(self, text: str) -> list[tuple[str, bool]]:
        """(JSON text, complete) of each <tool_call> so far; an unclosed one is complete once
        its JSON parses (the closing tag's tokens have not come yet)."""
        bodies, pos = [], 0
        while (start := text.find(self.tool_call_start_token, pos)) != -1:
            body_start = start + len(self.tool_call_start_token)
            end = text.find(self.tool_call_end_token, body_start)
            if end != -1:
                bodies.append((text[body_start:end].strip(), True))
                pos = end + len(self.tool_call_end_token)
                continue
            body = text[body_start:]
            body = body[:len(body) - partial_tag_overlap(body, self.tool_call_end_token)].strip()
            bodies.append((body, bool(body) and is_complete_json(body)))
            break
        return bodies

    def _arguments_diff(self, index: int, body: str, complete: bool) -> str | None:
        """The argument text of call index not sent yet. Of a complete call, the brace that
        closes the call itself is not part of its arguments."""
        match = self.arguments_regex.search(body)
        if match is None:
            return None
        arguments = body[match.end():]
        if complete:
            arguments = arguments.rstrip()
            if arguments.endswith("}"):
                arguments = arguments[:-1].rstrip()
        sent = self.streamed_args_for_tool[index]
        if len(arguments) <= len(sent):
            return None
        self.streamed_args_for_tool[index] = arguments
        return arguments[len(sent):]


def _name(call) -> str:
    """A parsed call's function name (vLLM's FunctionCall validation: a string)."""
    if not isinstance(call["name"], str):
        raise TypeError(f"the tool call name is not a string: {call['name']!r}")
    return call["name"]
