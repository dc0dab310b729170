"""Tool call parsers: a model's text to OpenAI tool calls, whole or streamed ("auto" tool choice),
by name (--tool-call-parser).

Mirrors vllm/tool_parsers/: the base and the registry (abstract_tool_parser.py), one file per
model's format, each registering itself with vLLM's decorator
(`@ToolParserManager.register_module("name")`) and helpers (utils.py). Every module of this package
is imported with it, so a new parser is its file and its tests: --tool-call-parser lists it; a
parser outside the package is a --tool-parser-plugin file. Left out: vLLM's lazy imports.
"""

import importlib
import pkgutil

from minicore.entrypoints.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
)

__all__ = ["ExtractedToolCallInformation", "ToolParser", "ToolParserManager"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
