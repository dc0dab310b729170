"""A chat request's tools: their checks, the constraint tool_choice puts on the output, and the
output read back as tool calls, whole or streamed.

Mirrors vLLM 0.32: the checks of ChatCompletionRequest.check_tool_usage and
check_structured_outputs_count (vllm/entrypoints/openai/chat_completion/protocol.py) and of
OnlineRenderer.render_chat (vllm/renderers/online_renderer.py: tool_choice other than "none" needs
--enable-auto-tool-choice and --tool-call-parser); the tools as the template sees them
(ChatCompletionToolsParam.model_dump); get_json_schema_from_tools (vllm/tool_parsers/utils.py),
which ToolParser.adjust_request makes the request's structured_outputs; the reading of
DelegatingParser._extract_tool_calls and its streaming twin (vllm/parser/abstract_parser.py); and
the finish reasons of chat_completion/serving.py ("tool_calls" for auto and required calls, "stop"
for a named one). Named and "required" tool choice are JSON-schema constrained, the way vLLM 0.32
runs them with VLLM_ENFORCE_STRICT_TOOL_CALLING=0: the named function's parameters, or an array of
{"name", "parameters"} objects. By default vLLM 0.32 instead constrains hermes to its own
<tool_call> format with an xgrammar structural tag (arguments unconstrained unless a tool is
strict). Unlike vLLM, a named or "required" call is streamed whole when the output ends, and a call
cut by max_tokens is no call, streamed or not. Left out: --exclude-tools-when-tool-choice-none
(tools always reach the template), kimi_k2 tool call ids, Mistral tokenizers (reasoning comes
off before: reasoning.py).
Adds OpenAI's limits on tools (MAX_TOOLS, MAX_TOOL_NAME_CHARS).
"""

import dataclasses
import json
from dataclasses import dataclass

from minicore.entrypoints.openai_errors import OpenAIError
from minicore.entrypoints.tool_parsers import ToolParser
from minicore.entrypoints.tool_records import (
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from minicore.sampling_params import SamplingParams, StructuredOutputsParams

# OpenAI's limits on a request's tools: a "required" tool choice compiles one grammar over all
# of them (10,000 tools took the engine past 8 GB), and every name goes into the prompt.
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 64
_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
_FUNCTION_FIELDS = {"name": (str,), "description": (str, type(None)),
                    "parameters": (dict, type(None)), "strict": (bool, type(None))}


@dataclass(slots=True)
class ChatTools:
    """A chat request's tools, checked: tools as the template takes them, and tool_choice
    ("none", "auto", "required" or the named function's {"type", "function"} object)."""
    tools: list[dict] | None
    tool_choice: str | dict
    parallel_tool_calls: bool | None
    parser_cls: type[ToolParser] | None

    @property
    def function_name(self) -> str | None:
        """The function a named tool choice forces."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    def json_schema(self) -> dict | None:
        """vLLM's get_json_schema_from_tools: what named or "required" tool choice constrains
        the output to, None for no constraint."""
        if (name := self.function_name) is not None:
            function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
            return _params_or_empty_object(function["parameters"])
        if self.tool_choice != "required":
            return None
        defs: dict = {}
        items = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": _params_or_empty_object(
                                     _hoist_defs(t["function"], defs))},
                  "required": ["name", "parameters"]} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if self.parallel_tool_calls is False:  # only an explicit false opts out
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """The request's params as ToolParser.adjust_request leaves them: the tool choice's
        schema replaces any other constraint (response_format's too), and the parser adjusts
        the rest when tools may be called."""
        if self.tools and self.tool_choice != "none":
            params = self.parser_cls.adjust_request(params)
        if (schema := self.json_schema()) is None:
            return params
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))

    def parser(self) -> "ToolCallParser":
        """A parser for one choice's output (parsers keep state while streaming)."""
        return ToolCallParser(self)


def check_tools(request, parser_cls: type[ToolParser] | None) -> ChatTools:
    """A chat request's tools, tool_choice and parallel_tool_calls, checked as vLLM does; a 400
    naming the field otherwise. parser_cls: the server's tool parser (None without
    --enable-auto-tool-choice and --tool-call-parser)."""
    if request.tools == []:
        raise OpenAIError("`tools` must not be an empty array. Either provide at least one tool "
                          "or omit the field entirely.", 400, "tools")
    if request.tools is not None and len(request.tools) > MAX_TOOLS:
        raise OpenAIError(f"`tools` has {len(request.tools)} tools; at most {MAX_TOOLS} are "
                          "allowed", 400, "tools")
    tools = None if request.tools is None else [_tool(i, t) for i, t in enumerate(request.tools)]
    choice = request.tool_choice
    if choice is None:
        # Omitted: "auto" with tools (vLLM's default). An explicit null is read as auto where
        # the server has a parser and as plain text otherwise, as vLLM reads it.
        auto = tools and (parser_cls is not None or "tool_choice" not in request.model_fields_set)
        choice = "auto" if auto else "none"
    elif choice != "none":
        _check_tool_choice(choice, tools)
    structured = request.structured_outputs
    if isinstance(choice, dict) and structured is not None and any(
            v is not None for v in (structured.json_, structured.regex, structured.choice)):
        raise OpenAIError("You can only either use constraints for structured outputs or tools, "
                          "not both.", 400, "structured_outputs")
    if parser_cls is None and choice != "none":
        raise OpenAIError(_needs_parser(choice), 400, "tool_choice")
    return ChatTools(tools, choice, request.parallel_tool_calls, parser_cls)


def _tool(i: int, tool) -> dict:
    """A tool as vLLM's ChatCompletionToolsParam.model_dump() hands it to the template."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type", "function") != "function":
        raise OpenAIError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}',
                          400, "tools")
    if extra := sorted(set(tool) - {"type", "function"}) or sorted(
            set(function) - set(_FUNCTION_FIELDS)):
        raise OpenAIError(f"tools[{i}]: unknown field {extra[0]!r}", 400, "tools")
    for name, types in _FUNCTION_FIELDS.items():
        if not isinstance(function.get(name), types):
            raise OpenAIError(f"tools[{i}].function.{name} must be "
                              f"{' or '.join(t.__name__ for t in types)}", 400, "tools")
    if not 0 < len(function["name"]) <= MAX_TOOL_NAME_CHARS:
        raise OpenAIError(f"tools[{i}].function.name must be 1 to {MAX_TOOL_NAME_CHARS} "
                          f"characters, got {len(function['name'])}", 400, "tools")
    dump = {"name": function["name"], "description": function.get("description"),
            "parameters": function.get("parameters")}
    if function.get("strict") is not None:
        dump["strict"] = function["strict"]
    return {"type": "function", "function": dump}


def _check_tool_choice(choice, tools: list[dict] | None) -> None:
    if tools is None:
        raise OpenAIError("When using `tool_choice`, `tools` must be set.", 400, "tool_choice")
    if choice in ("auto", "required"):
        return
    if not isinstance(choice, dict) or choice.get("type", "function") != "function":
        raise OpenAIError(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", '
                          '"auto" or "required" are supported.', 400, "tool_choice")
    function = choice.get("function")
    if not isinstance(function, dict):
        raise OpenAIError(f"Invalid value for `function`: `{function}` in `tool_choice`! "
                          f"{_CORRECT_USAGE}", 400, "tool_choice.function")
    if "name" not in function:
        raise OpenAIError(f"Expected field `name` in `function` in `tool_choice`! "
                          f"{_CORRECT_USAGE}", 400, "tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise OpenAIError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
                          f"{_CORRECT_USAGE}", 400, "tool_choice.function.name")
    if all(tool["function"]["name"] != name for tool in tools):
        raise OpenAIError("The tool specified in `tool_choice` does not match any of the "
                          "specified `tools`", 400, "tool_choice")


def _needs_parser(choice) -> str:
    """vLLM's messages for a tool choice the server cannot parse."""
    if choice == "auto":
        return ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set")
    described = (f'function "{choice["function"]["name"]}"' if isinstance(choice, dict)
                 else f'"{choice}"')
    return f"tool_choice={described} requires --tool-call-parser to be set"


def _params_or_empty_object(params: dict | None) -> dict:
    # No parameters still means a JSON object of arguments.
    return params if params else {"type": "object", "properties": {}}


def _hoist_defs(function: dict, defs: dict) -> dict | None:
    """The function's parameters without their $defs, which go to the array schema's own (one
    schema per name across the tools, as vLLM's _get_tool_schema_defs)."""
    params = function["parameters"]
    if params is None or "$defs" not in params:
        return params
    params = dict(params)
    own = params.pop("$defs")
    if not isinstance(own, dict):
        raise OpenAIError(f"`$defs` in the parameters of tool '{function['name']}' must be an "
                          f"object, got {type(own).__name__}.", 400, "tools")
    for name, schema in own.items():
        if defs.setdefault(name, schema) != schema:
            raise OpenAIError(f"Tool definition '{name}' has multiple schemas, which is not "
                              "supported.", 400, "tools")
    return params


@dataclass(slots=True)
class ToolCallParser:
    """One choice's output as content and tool calls, whole (parse) or delta by delta
    (parse_delta), as the request's tool choice reads it."""
    tools: ChatTools
    tool_parser: ToolParser | None = None  # "auto": the server's parser
    previous_text: str = ""
    # Streaming: a tool call was sent (the finish reason says so).
    tools_streamed: bool = False

    def __post_init__(self):
        if self.tools.tool_choice == "auto":
            self.tool_parser = self.tools.parser_cls(self.tools.tools)

    def parse(self, text: str, finish_reason: str) -> tuple[ChatMessage, str]:
        """The message of a whole output and the choice's finish reason. A named or "required"
        call cut by max_tokens is no call (vLLM's test_max_tokens_with_tool_choice_required)."""
        choice, name = self.tools.tool_choice, self.tools.function_name
        if name is not None:
            whole = text.strip() and (finish_reason != "length" or _is_json(text))
            calls = [ToolCall(function=FunctionCall(name, text))] if whole else []
            return ChatMessage("assistant", "", calls), finish_reason
        if choice == "required":
            calls = [ToolCall(function=FunctionCall(n, json.dumps(p, ensure_ascii=False)))
                     for n, p in _required_calls(text)]
            return (ChatMessage("assistant", "", self._first_only(calls)),
                    "tool_calls" if finish_reason == "stop" else finish_reason)
        if self.tool_parser is not None:
            info = self.tool_parser.extract_tool_calls(text)
            if info.tools_called:
                content = info.content if info.content and info.content.strip() else None
                return (ChatMessage("assistant", content, self._first_only(info.tool_calls)),
                        "tool_calls")
        return ChatMessage("assistant", text), finish_reason

    def parse_delta(self, delta_text: str, finish_reason: str | None) -> DeltaMessage | None:
        """The delta to send for the output's next piece (finish_reason: the output's, once it
        ended), None for nothing yet. A named or "required" call goes out whole when the output
        ends, as parse reads it: one cut by max_tokens never reaches the client (vLLM streams
        them as they are written)."""
        previous, current = self.previous_text, self.previous_text + delta_text
        self.previous_text = current
        if self.tools.function_name is not None or self.tools.tool_choice == "required":
            message = None if finish_reason is None else self._whole_calls(current, finish_reason)
        elif self.tool_parser is not None:
            message = self.tool_parser.extract_tool_calls_streaming(previous, current, delta_text)
        else:
            message = DeltaMessage(content=delta_text) if delta_text else None
        if message is not None and message.tool_calls:
            self.tools_streamed = True
            if self.tools.parallel_tool_calls is False:
                message.tool_calls = [c for c in message.tool_calls if c.index == 0]
        return message

    def stream_finish_reason(self, finish_reason: str | None) -> str | None:
        """A streamed choice's finish reason (None while it runs): "tool_calls" once a call was
        sent and the model stopped by itself, except for a named tool choice."""
        if self.tools_streamed and self.tools.function_name is None and finish_reason == "stop":
            return "tool_calls"
        return finish_reason

    def _whole_calls(self, text: str, finish_reason: str) -> DeltaMessage | None:
        calls = self.parse(text, finish_reason)[0].tool_calls
        return DeltaMessage(tool_calls=[
            DeltaToolCall(index=i, id=c.id, type=c.type,
                          function=DeltaFunctionCall(c.function.name, c.function.arguments))
            for i, c in enumerate(calls)]) if calls else None

    def _first_only(self, calls: list[ToolCall]) -> list[ToolCall]:
        """vLLM's maybe_filter_parallel_tool_calls."""
        return calls[:1] if self.tools.parallel_tool_calls is False else calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _required_calls(text: str) -> list[tuple[str, dict | None]]:
    """(name, parameters) of each call of a "required" output, none if it is not a JSON array
    of such objects (vLLM's TypeAdapter(list[FunctionDefinition]) validation)."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return []
    if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str)
            and isinstance(i.get("parameters"), dict | None) for i in items):
        return []
    return [(i["name"], i.get("parameters")) for i in items]
