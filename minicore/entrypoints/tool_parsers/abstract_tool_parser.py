"""ToolParser, the base of every tool call parser, and ToolParserManager, the parsers by name.

Mirrors vllm/tool_parsers/abstract_tool_parser.py. A parser keeps state while streaming, so each
choice has its own. Left out: the tokenizer and tools vLLM's constructor takes (no parser here
uses them), lazy registration (a plugin file registers its parsers as it runs).
"""

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from minicore.entrypoints.tool_records import DeltaMessage, ToolCall
from minicore.sampling_params import SamplingParams


@dataclass(slots=True)
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    # Text the model wrote besides the calls (None when there is none).
    content: str | None = None


class ToolParser:
    """One model's tool call format: extract_tool_calls reads a whole output,
    extract_tool_calls_streaming the output so far, one delta at a time."""

    def __init__(self, tools: list[dict] | None = None):
        # The request's tools (vLLM's ToolParser takes them too): their schemas type arguments.
        self.tools = tools
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

    @classmethod
    def import_tool_parser(cls, path: str) -> None:
        """Run a plugin file, whose parsers register themselves (--tool-parser-plugin)."""
        file = Path(path).expanduser()
        spec = importlib.util.spec_from_file_location(file.stem, file)
        if not file.is_file() or spec is None:
            raise ValueError(f"--tool-parser-plugin {path!r}: no such Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[file.stem] = module
        spec.loader.exec_module(module)
