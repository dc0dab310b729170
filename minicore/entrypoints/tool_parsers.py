"""Tool call parsers: a model's text to OpenAI tool calls, whole or streamed ("auto" tool choice).

Mirrors vllm/tool_parsers/abstract_tool_parser.py (ToolParser, ToolParserManager) and
vllm/tool_parsers/hermes_tool_parser.py (Hermes2ProToolParser: each call written as
<tool_call>{"name": ..., "arguments": {...}}</tool_call>, text before the first call is content),
and extract_required_tool_call_streaming of vllm/tool_parsers/streaming.py (the calls of a
"required" tool choice's JSON array, streamed as they are written).
A parser keeps state while streaming, so each choice has its own. The registry keeps vLLM's idea
(parsers by name, for --tool-call-parser), without lazy imports or --tool-parser-plugin.
Left out: the other models' parsers, token ids (hermes reads text only), the tokenizer and tools
vLLM's constructor takes (hermes uses neither), and the xgrammar structural tag vLLM 0.32 builds
for hermes (tool_calls.py says why).
"""

import dataclasses
import json
import logging
import re
from dataclasses import dataclass, field

import msgspec

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


@dataclass(slots=True)
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    # Text the model wrote besides the calls (None when there is none).
    content: str | None = None


class ToolParser:
    """One model's tool call format: extract_tool_calls reads a whole output,
    extract_tool_calls_streaming the output so far, one delta at a time."""

    def __init__(self):
        # vLLM's streaming state: each call's name once sent, and its arguments sent.
        self.prev_tool_call_arr: list[dict] = []
        self.streamed_args_for_tool: list[str] = []

    @classmethod
    def adjust_request(cls, params: SamplingParams) -> SamplingParams:
        """The params of a request that may call tools, as the parser needs them (vLLM's
        adjust_request past the schema, which ChatTools.sampling_params sets)."""
        return params

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> DeltaMessage | None:
        """The delta to send for the output current_text (previous_text plus delta_text), None
        when there is nothing to send yet."""
        raise NotImplementedError


class ToolParserManager:
    """The tool parsers by name (vLLM's registry, eager only)."""
    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str):
        def register(parser_cls: type[ToolParser]) -> type[ToolParser]:
            cls.tool_parsers[name] = parser_cls
            return parser_cls
        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise KeyError(f"Tool parser '{name}' not found.")
        return cls.tool_parsers[name]

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(cls.tool_parsers)


def partial_tag_overlap(text: str, tag: str) -> int:
    """The length of the longest proper prefix of tag that text ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # nested past Python's recursion limit: not a call
        return False
    return True


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    # A call's body: between the tags, or from an unclosed tag to the end of the output.
    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
    name_regex = re.compile(r'"name"\s*:\s*"([^"]+)"')
    arguments_regex = re.compile(r'"arguments"\s*:\s*')

    def __init__(self):
        super().__init__()
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


# The "required" array streamed (vLLM's extract_required_tool_call_streaming): one scan of the text
# so far finds each element's name and the span of its parameters; spans are prefix-stable, so the
# previous text's length says what was sent.

_KEY, _COLON, _VALUE, _STRING, _CONTAINER, _SCALAR, _AFTER = range(7)


@dataclass(slots=True)
class _Span:
    """One element of the array: its name once its string is closed (name_end just past it),
    its parameters' start and end (None while still written)."""
    name: str | None = None
    name_end: int = 0
    args_start: int | None = None
    args_end: int | None = None

    def ready_at(self, length: int) -> bool:
        """Whether the text's first length characters made this call sendable."""
        return self.ready and self.name_end <= length and self.args_start < length

    @property
    def ready(self) -> bool:
        return self.name is not None and self.args_start is not None


@dataclass(slots=True)
class _Scan:
    """A scan of a (partial) "required" array at the level of its elements' keys; nested
    values and strings are skipped whole, text after the array is ignored."""
    text: str
    spans: list[_Span] = field(default_factory=list)
    depth: int = 0  # {} and [] nesting: element objects' keys sit at 2
    expect: int = _KEY
    key: str | None = None
    value_start: int = 0

    def run(self) -> list[_Span]:
        text, in_string, escaped, string_start = self.text, False, False, 0
        for i, ch in enumerate(text):
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                    if self.depth == 2 and self.expect == _KEY:
                        self.key, self.expect = text[string_start + 1:i], _COLON
                    elif self.depth == 2 and self.expect == _STRING:
                        self.end_value(i + 1)
            elif ch == '"':
                in_string, string_start = True, i
                if self.depth == 2 and self.expect == _VALUE:
                    self.start_value(i, _STRING)
            elif ch in "{[":
                if self.depth < 2 and ch != "[{"[self.depth]:
                    break  # not an array of objects
                if self.depth == 1:
                    self.spans.append(_Span())
                    self.expect, self.key = _KEY, None
                elif self.depth == 2 and self.expect == _VALUE:
                    self.start_value(i, _CONTAINER)
                self.depth += 1
            elif ch in "}]":
                if self.depth == 2 and self.expect == _SCALAR:
                    self.end_value(i)
                self.depth -= 1
                if self.depth == 2 and self.expect == _CONTAINER:
                    self.end_value(i + 1)
                elif self.depth <= 0:
                    break
            elif self.depth == 2 and self.spans:
                self.punctuation(i, ch)
        return self.spans

    def punctuation(self, i: int, ch: str) -> None:
        if ch == ":" and self.expect == _COLON:
            self.expect = _VALUE
        elif ch == "," or ch.isspace():
            if self.expect == _SCALAR:
                self.end_value(i)
            if ch == ",":
                self.expect, self.key = _KEY, None
        elif self.expect == _VALUE:
            self.start_value(i, _SCALAR)

    def start_value(self, i: int, state: int) -> None:
        self.value_start, self.expect = i, state
        if self.key == "parameters":
            self.spans[-1].args_start = i

    def end_value(self, end: int) -> None:
        span = self.spans[-1]
        if self.key == "parameters":
            span.args_end = end
        elif self.key == "name" and self.expect == _STRING:
            try:
                span.name, span.name_end = json.loads(self.text[self.value_start:end]), end
            except ValueError:
                span.name = None  # never sendable, as the whole output would not parse
        self.expect = _AFTER


def extract_required_tool_call_streaming(previous: str, current: str) -> DeltaMessage | None:
    """Each call of the array with something unsent, in order: a new call's id, type, name and
    parameters so far; a call already announced, the rest of its parameters' text."""
    calls = []
    for index, span in enumerate(_Scan(current).run()):
        if not span.ready:
            break  # elements come in order: nothing later is ready either
        end = len(current) if span.args_end is None else span.args_end
        if span.ready_at(len(previous)):
            if arguments := current[min(end, len(previous)):end]:
                calls.append(DeltaToolCall(index=index,
                                           function=DeltaFunctionCall(arguments=arguments)))
        else:
            calls.append(DeltaToolCall(
                index=index, id=make_tool_call_id(), type="function",
                function=DeltaFunctionCall(span.name, current[span.args_start:end])))
    return DeltaMessage(tool_calls=calls) if calls else None

