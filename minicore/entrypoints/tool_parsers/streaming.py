"""extract_required_tool_call_streaming: the calls of a "required" tool choice's JSON array,
streamed as they are written (vllm/tool_parsers/streaming.py)."""

import json
from dataclasses import dataclass, field

from minicore.entrypoints.tool_records import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    make_tool_call_id,
)

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
