"""Tool call parsers are plug-ins (minicore/entrypoints/tool_parsers/): a file of that package
that registers its parser with vLLM's decorator is found with the package, so a new parser is
that file and its tests. Shown with a parser written here, in a file of the package for the
test's duration: --tool-call-parser offers it and the registry builds it."""

import importlib
import subprocess
import sys
import textwrap

import minicore.entrypoints.tool_parsers as tool_parsers
from minicore.entrypoints.tool_parsers import ToolParserManager

ECHO = textwrap.dedent('''
    """EchoToolParser: no calls, the output as content (a test's parser)."""
    from minicore.entrypoints.tool_parsers.abstract_tool_parser import (
        ExtractedToolCallInformation,
        ToolParser,
        ToolParserManager,
    )


    @ToolParserManager.register_module("echo_for_test")
    class EchoToolParser(ToolParser):
        def extract_tool_calls(self, model_output):
            return ExtractedToolCallInformation(False, [], model_output)
''')
def test_the_shipped_parsers_register_themselves():
    assert ToolParserManager.list_registered() == ["hermes"]


def test_a_new_parser_is_one_file(plugin_file):
    module = plugin_file(tool_parsers, "echo_for_test", ECHO, ToolParserManager.tool_parsers,
                         "echo_for_test")
    help_text = subprocess.run([sys.executable, "-m", "minicore", "serve", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    assert "--tool-call-parser {echo_for_test,hermes}" in help_text
    importlib.import_module(module)  # what importing the package does in a fresh process
    parser = ToolParserManager.get_tool_parser("echo_for_test")()
    assert parser.extract_tool_calls("no call").content == "no call"
